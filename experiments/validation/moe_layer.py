"""One MoE layer's forward and backward beside published per-layer measurements: ``python -m
experiments.validate --moe-layer`` (and ``--moe-layer --fit``).

Each row of ``experiments/data/moe_layer.json`` is one measured MoELayer (Megatron-LM's ``moe_perf`` test:
force-balanced routing, ``tokens_per_gpu`` tokens on each of the EP group's GPUs, no attention), with its
role, ``calibration`` or ``check``, fixed before any fit (the file's ``provenance`` says which constants the
calibration rows may set). :func:`price_layer` prices a row from its configuration alone (the measured
times are never read) with the same terms the simulator charges a MoE layer of a training step
(:mod:`relibra.cost.passes`):

* forward: a third of the expert GEMMs' and the shared experts' fwd + bwd seconds
  (:data:`relibra.cost.step.FORWARD_FLOPS_SHARE`), half of the router's, the permutation's and the FP8
  casts' (:data:`~relibra.cost.step.FORWARD_BYTES_SHARE`), the dispatch and the combine of the forward (half
  of the four all-to-all phases, latency included), and one direction of host time
  (``host_overhead_s``, :meth:`relibra.cost.step.WholeStepTerms.launch_time`);
* backward: the rest of each, and the second direction of host time.

What the rows can and cannot identify: each iteration of the test queues a long GEMM "to hide the router
launch overhead" before one isolated layer, so the host launches the layer's first kernels ahead of the GPU
and only the host time after the dispatcher's device-to-host sync can show in the timings. A whole step's
per-layer host time (``cluster.hardware.host_overhead_s``: every launch the GPU waits for once the host falls
behind, layer after layer) is not in them. So a row is priced with no step host time, and :func:`fit_layer`
fits the one host term the rows do see, the isolated layer's post-sync host time (:data:`POST_SYNC`, stored
in the data file, never in a cluster yaml), by least squares of ``log(model / measured)`` over the forward
and backward of every calibration row at the yaml's GEMM efficiency; ``joint`` also fits the efficiency (a
grid over it, each point's host time solved on its line), as a diagnostic. Check rows are never read by
it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra import compose, initialize_config_dir

from experiments.config.build import build_cluster, build_training
from experiments.config.errors import ConfigError
from experiments.config.presets import CONF_DIR
from experiments.config.spec import build_spec
from experiments.validation.data_files import DATA_DIR, read_rows_file
from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.cost.step import FORWARD_BYTES_SHARE, FORWARD_FLOPS_SHARE, TrainingSpec

__all__ = [
    "DATA_FILE",
    "FITTED",
    "POST_SYNC",
    "LayerFit",
    "LayerTimes",
    "fit_layer",
    "layer_table",
    "load_layer_rows",
    "price_layer",
]

DATA_FILE = DATA_DIR / "moe_layer.json"
FITTED = ("cluster.hardware.gemm_efficiency", "cluster.hardware.host_overhead_s")
"""The constants a row is priced with in place of the cluster yaml's, in the order :class:`LayerFit` holds
them."""
POST_SYNC = "layer.post_sync_host_s"
"""The data file's ``fitted_constants`` key of the isolated layer's host time (module doc): a property of
the measurement's setup, never written into a cluster yaml."""
ROLES = ("calibration", "check")
_EFFICIENCY_RANGE = (0.4, 1.0)
"""The efficiencies searched (a fraction of the datasheet peak: above 1 is impossible)."""


@dataclass(frozen=True)
class LayerTimes:
    """One MoE layer's priced seconds, forward and backward, and the terms they are made of."""

    forward_s: float
    backward_s: float
    terms: dict[str, float]
    """fwd + bwd seconds of each term: ``experts``, ``expert_launch``, ``shared``, ``router``, ``permute``,
    ``routing_map``, ``fp8_cast``, ``comm``, ``host`` (``expert_launch`` and ``routing_map``: 0 unless
    ``cluster.hardware.per_expert_costs``, :mod:`relibra.cost.grouped_gemm`)."""


def load_layer_rows(path: str | Path = DATA_FILE) -> dict[str, Any]:
    """The per-layer data file, its roles checked; one :class:`ConfigError` naming the path otherwise."""
    doc = read_rows_file(path, "per-layer data")
    for row in doc["rows"]:
        if not isinstance(row, dict) or row.get("role") not in ROLES:
            rid = row.get("id") if isinstance(row, dict) else row
            raise ConfigError(f"per-layer data {path}: row {rid!r}: role must be one of {ROLES}")
    return doc


@functools.lru_cache(maxsize=64)
def _composed(overrides: tuple[str, ...]) -> tuple[ClusterSpec, TrainingSpec]:
    """The cluster and training of ``overrides`` composed on ``experiments/conf`` (once per row)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="moe_layer"):
        spec = build_spec(compose("config", overrides=[*overrides, "simulator.step=whole"]))
    return build_cluster(spec), build_training(spec)


def _cost(row: dict[str, Any], constants: dict[str, float]) -> CostModel:
    """The row's cost model: its overrides composed on ``experiments/conf``, its proxy model, and
    ``constants`` (keys of :data:`FITTED`) in place of the cluster yaml's; the all-to-all never overlapped
    (the layer runs alone)."""
    cluster, training = _composed(tuple(row["overrides"]))
    unknown = set(constants) - set(FITTED)
    if unknown:
        raise ConfigError(f"per-layer constants: {sorted(unknown)} are not among {list(FITTED)}")
    hw = cluster.hardware
    if FITTED[0] in constants:
        hw = replace(hw, gemm_efficiency=float(constants[FITTED[0]]))
    if FITTED[1] in constants:
        hw = replace(hw, host_overhead_s=float(constants[FITTED[1]]))
    cluster = replace(cluster, hardware=hw, ep_overlap=False)
    return CostModel(cluster, ModelSpec(**row["model"]), training=training)


def price_layer(row: dict[str, Any], constants: dict[str, float] | None = None) -> LayerTimes:
    """The forward and backward seconds of the row's layer (module doc); never reads its measurements.

    Force-balanced routing (the default): each of the ``G`` GPUs holds ``tokens_per_gpu`` tokens and sends
    ``T k / E`` of them to every expert, so every expert computes ``G T k / E`` tokens on its home GPU
    (``E / G`` each, contiguous). A row with ``routing.load`` (float [G][E], the tokens each GPU sent each
    expert; ``experiments/validation/gpu_measurements.py`` writes it for measured imbalance) is priced with
    that load on the same static placement: the busiest GPU's expert GEMMs, permutation and casts, the busiest
    link.
    """
    # NOTE: the isolated layer has no step host time (module doc): 0 unless the caller prices one.
    cost = _cost(row, {FITTED[1]: 0.0, **(constants or {})})
    m, g = cost.model, cost.cluster.num_gpus
    if m.num_experts % g:
        raise ConfigError(f"per-layer row {row.get('id')!r}: {m.num_experts} experts over {g} GPUs")
    t = float(row["tokens_per_gpu"])
    given = (row.get("routing") or {}).get("load")
    if given is None:
        load = np.full((g, m.num_experts), t * m.top_k / m.num_experts)  # [G, E]
    else:
        load = np.asarray(given, dtype=np.float64)
        if load.shape != (g, m.num_experts) or not np.isfinite(load).all() or (load < 0).any():
            raise ConfigError(
                f"per-layer row {row.get('id')!r}: routing.load must be {g} x {m.num_experts} counts >= 0"
            )
    home = np.arange(m.num_experts) // (m.num_experts // g)  # [E]
    assign = np.zeros((m.num_experts, g))  # [E, G]
    assign[np.arange(m.num_experts), home] = load.sum(axis=0)
    received = np.array([assign.sum(axis=0).max()])
    tokens = np.array([t])
    compute = cost.gpu_compute_time(assign)  # [G]: grouped GEMMs, and the per-expert launches when priced
    launch = float(cost.expert_launch_time(assign)[int(np.argmax(compute))])
    terms = {
        "experts": float(compute.max()) - launch,
        "expert_launch": launch,
        "shared": float(cost.shared_expert_time(tokens)[0]),
        "router": float(cost.router_time(tokens)[0]),
        "permute": float(cost.permute_time(received)[0]),
        "routing_map": float(cost.routing_map_time(assign).max()),
        "fp8_cast": float(cost.expert_cast_time(received)[0] + cost.shared_cast_time(tokens)[0]),
        "comm": float(cost.moe_comm_time(load, assign).max()),
        "host": cost.launch_time(1, 2.0),
    }
    # NOTE: the per-expert launches follow the GEMMs (two of their six forward), the routing map the bytes.
    flops = terms["experts"] + terms["expert_launch"] + terms["shared"]
    nbytes = terms["router"] + terms["permute"] + terms["routing_map"] + terms["fp8_cast"]
    forward = (
        FORWARD_FLOPS_SHARE * flops + FORWARD_BYTES_SHARE * nbytes + 0.5 * terms["comm"] + 0.5 * terms["host"]
    )
    total = sum(terms.values())
    return LayerTimes(forward_s=forward, backward_s=total - forward, terms=terms)


@dataclass(frozen=True)
class LayerFit:
    """The fitted post-sync host time (and, jointly, the efficiency) and what they were fitted to."""

    gemm_efficiency: float
    """The fitted efficiency; NaN when it was held at the cluster yaml's (the default fit)."""
    host_overhead_s: float
    """The isolated layer's host seconds per direction after the sync (:data:`POST_SYNC`)."""
    rows: tuple[str, ...]
    """The calibration rows' ids, in the file's order."""
    log_rms: float
    """Root mean square of ``log(model / measured)`` over the rows' forward and backward at the fit."""
    leave_one_out: tuple[tuple[float, float], ...]
    """(efficiency, host seconds) fitted without each row in turn."""

    def entries(self) -> dict[str, Any]:
        """The data file's ``fitted_constants`` entries."""
        common = {
            "rows": list(self.rows),
            "objective": "least squares of log(model / measured) over the forward and backward of the "
            "calibration rows (experiments/validation/moe_layer.py)",
            "log_rms": round(self.log_rms, 6),
        }
        eff = [e for e, _ in self.leave_one_out]
        host = [h for _, h in self.leave_one_out]
        out = {POST_SYNC: {"value": self.host_overhead_s, **common, "leave_one_out": [min(host), max(host)]}}
        if not math.isnan(self.gemm_efficiency):
            out[FITTED[0]] = {"value": self.gemm_efficiency, **common, "leave_one_out": [min(eff), max(eff)]}
        return out


def _line(rows: list[dict[str, Any]], efficiency: float | None) -> np.ndarray:
    """Every row's forward and backward seconds at host time 0 [2R] (``efficiency`` None: the cluster
    yaml's); the priced seconds grow by exactly the host time, one direction each."""
    constants = {FITTED[1]: 0.0} if efficiency is None else {FITTED[0]: efficiency, FITTED[1]: 0.0}
    base = [price_layer(r, constants) for r in rows]
    return np.array([x for b in base for x in (b.forward_s, b.backward_s)])


def _best_host(zero: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """(host seconds >= 0 minimising the sum of squared log errors, that sum) on one efficiency's line:
    a grid over ``[0, 2 max(target - zero)]``, then golden-section search between its best neighbours."""
    upper = max(float(np.max(target - zero)), 0.0) * 2.0 + 1e-6

    def objective(h: np.ndarray) -> np.ndarray:
        return np.sum((np.log(zero[None, :] + h[:, None]) - np.log(target)[None, :]) ** 2, axis=1)

    grid = np.linspace(0.0, upper, 2001)
    k = int(np.argmin(objective(grid)))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        fa, fb = objective(np.array([a, b]))
        hi, lo = (b, lo) if fa <= fb else (hi, a)
    best = 0.5 * (lo + hi)
    fbest, fgrid = objective(np.array([best, grid[k]]))
    return (float(best), float(fbest)) if fbest < fgrid else (float(grid[k]), float(fgrid))


def _fit(target: np.ndarray, lines: dict[float | None, np.ndarray]) -> tuple[float | None, float, float]:
    """(efficiency, host, objective) minimising the objective over the efficiencies of ``lines``."""
    best: tuple[float | None, float, float] = (None, 0.0, math.inf)
    for eff, zero in lines.items():
        host, err = _best_host(zero, target)
        if err < best[2]:
            best = (eff, host, err)
    return best


def fit_layer(doc: dict[str, Any], joint: bool = False) -> LayerFit:
    """Fit the calibration rows of ``doc`` (module doc); check rows are never priced.

    Default: the post-sync host time alone, at the cluster yaml's ``gemm_efficiency``. ``joint``: with the
    efficiency, on a grid of 0.005 over ``[0.4, 1.0]`` (a diagnostic: where the layer's other terms would put
    the GEMMs).
    """
    rows = [r for r in doc["rows"] if r["role"] == "calibration"]
    if not rows:
        raise ConfigError("fit the per-layer constants: the data has no calibration rows")
    target = np.array([x for r in rows for x in (r["forward_ms"] / 1e3, r["backward_ms"] / 1e3)])
    grid: list[float | None] = (
        [float(e) for e in np.round(np.arange(_EFFICIENCY_RANGE[0], _EFFICIENCY_RANGE[1] + 1e-9, 0.005), 3)]
        if joint
        else [None]
    )
    lines = {e: _line(rows, e) for e in grid}
    eff, host, _ = _fit(target, lines)
    loo = []
    for k in range(len(rows)):
        keep = np.array([2 * i + d for i in range(len(rows)) if i != k for d in (0, 1)])
        e_k, h_k, _ = _fit(target[keep], {e: z[keep] for e, z in lines.items()})
        loo.append((float("nan") if e_k is None else e_k, h_k))
    priced = lines[eff] + host
    return LayerFit(
        gemm_efficiency=float("nan") if eff is None else eff,
        host_overhead_s=host,
        rows=tuple(str(r["id"]) for r in rows),
        log_rms=float(np.sqrt(np.mean(np.log(priced / target) ** 2))),
        leave_one_out=tuple(loo),
    )


def layer_table(path: str | Path = DATA_FILE, constants: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per measured layer: measured and priced forward and backward (ms), model / measured of each
    and of their sum, the role, and the priced terms (ms, fwd + bwd); with the constants of
    ``experiments/conf`` and the file's stored post-sync host time unless ``constants`` replaces them."""
    doc = load_layer_rows(path)
    stored = (doc.get("fitted_constants") or {}).get(POST_SYNC)
    if stored is not None:
        constants = {FITTED[1]: float(stored["value"]), **(constants or {})}
    out = []
    for row in doc["rows"]:
        p = price_layer(row, constants)
        fwd, bwd = float(row["forward_ms"]), float(row["backward_ms"])
        out.append(
            {
                "id": row["id"],
                "role": row["role"],
                "forward_ms": fwd,
                "model_forward_ms": p.forward_s * 1e3,
                "backward_ms": bwd,
                "model_backward_ms": p.backward_s * 1e3,
                "ratio_forward": p.forward_s * 1e3 / fwd,
                "ratio_backward": p.backward_s * 1e3 / bwd,
                "ratio": (p.forward_s + p.backward_s) * 1e3 / (fwd + bwd),
                **{f"{k}_ms": v * 1e3 for k, v in p.terms.items()},
            }
        )
    return pd.DataFrame(out)
