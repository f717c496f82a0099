"""What imbalance costs, beside the public measurement of it: ``python -m experiments.validate --penalty``.

Each row of ``experiments/data/penalty.json`` is a published pair of runs of one configuration, dropless and
forced-balance (Megatron's ``moe_router_force_load_balancing``), with its measured penalty
``forced / dropless - 1`` (the same FLOPs, so the ratio of step times). Every row is a check: nothing is
fitted to it. A row's parallel dimensions, micro-batches and whole step are the end-to-end validation's
(:func:`experiments.validation.end_to_end.row_config`,
:func:`~experiments.validation.end_to_end.row_workload`); the two runs differ only in their routing:

* forced: uniform top-k (:func:`baselines.force_balanced.uniform_routing`);
* dropless: a routing source (:data:`SOURCES`), on Megatron's static placement.

The simulated penalty is ``step(dropless) / step(forced) - 1``. Since no public trace with a time dimension
gives the routing of a dropless run with aux loss, several sources are priced side by side, each saying what
it assumes, and the skew each gives (``skew_mean``: max / mean of the GPUs' expert tokens, averaged over
micro-batches and layers) is reported with it. :func:`implied_std` splits a remaining gap between the
routing and the cost model: it finds the force-biased bias (routing whose skew is known exactly,
:mod:`relibra.trace.biased`) at which the cost model reproduces the measured penalty, and the skew that
routing has: if that skew is one the model's real routing plausibly has, the routing source fell short; if
it exceeds what the real popularity gives, the cost model prices imbalance too cheaply.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from baselines.force_balanced import uniform_routing
from experiments.config.build import build_cluster, build_cost, build_model, build_planner, sim_options
from experiments.config.errors import ConfigError
from experiments.validation.data_files import DATA_DIR, read_rows_file
from experiments.validation.end_to_end import row_config, row_workload
from relibra.simulator import simulate
from relibra.trace.biased import force_biased_shares, popularity_counts
from relibra.types import SampleCounts

__all__ = ["DATA_FILE", "SOURCES", "implied_std", "load_penalty_rows", "penalty_table", "simulate_pair"]

DATA_FILE = DATA_DIR / "penalty.json"
SHARED = Path(
    os.environ.get("RELIBRA_SHARED_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces")
)
QWEN3_COUNTS = {"qwen3-235b-a22b": "counts235b.json", "qwen3-30b-a3b": "counts30b.json"}
"""The real per-layer expert counts of ``../shared/traces/qwen3-moe-counts`` per model (SGLang prefill)."""
SOURCES = ("popularity", "force_biased:0.5", "force_biased:1.0")
"""The dropless routing sources priced by default: the model's real per-layer popularity (where the shared
traces hold it), and Megatron's force-biased router at two bias widths."""

Routing = Callable[[SampleCounts, int], SampleCounts]


def load_penalty_rows(path: str | Path = DATA_FILE) -> dict[str, Any]:
    """The penalty data file; one :class:`ConfigError` naming the path otherwise."""
    doc = read_rows_file(path, "penalty data")
    for row in doc["rows"]:
        for key in ("id", "config", "overrides", "forced_tflops_per_gpu", "dropless_tflops_per_gpu"):
            if not isinstance(row, dict) or key not in row:
                rid = row.get("id") if isinstance(row, dict) else row
                raise ConfigError(f"penalty data {path}: row {rid!r} lacks {key!r}")
        if row.get("role") != "check":
            raise ConfigError(
                f"penalty data {path}: row {row['id']!r}: role must be 'check' (nothing is fitted)"
            )
    return doc


def measured_penalty(row: dict[str, Any]) -> float:
    """``forced / dropless - 1`` of the row's published TFLOPS per GPU."""
    return float(row["forced_tflops_per_gpu"]) / float(row["dropless_tflops_per_gpu"]) - 1.0


def popularity_shares(model: str, shared: Path = SHARED) -> np.ndarray:
    """float64 [L, E]: the model's real per-layer expert shares (``qwen3-moe-counts``); a
    :class:`ConfigError` naming the file when the shared traces do not hold it."""
    name = QWEN3_COUNTS.get(model)
    if name is None:
        raise ConfigError(f"routing 'popularity': no measured popularity for model {model!r}")
    path = shared / "qwen3-moe-counts" / name
    try:
        counts = np.asarray(json.loads(path.read_text())["counts"], dtype=np.float64)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise ConfigError(f"routing 'popularity': {path} cannot be read ({exc})") from exc
    return counts / counts.sum(axis=1, keepdims=True)


def routing_source(name: str, model: str, num_layers: int, num_experts: int, top_k: int) -> Routing:
    """The dropless routing ``name`` (``popularity`` or ``force_biased:STD``) as counts -> counts."""
    if name == "popularity":
        shares = popularity_shares(model)
        if shares.shape != (num_layers, num_experts):
            raise ConfigError(
                f"routing 'popularity': shape {shares.shape}, model has {(num_layers, num_experts)}"
            )
        return lambda counts, seed: popularity_counts(counts, shares, seed, f"popularity of {model}")
    kind, _, value = name.partition(":")
    if kind == "force_biased":
        try:
            std = float(value)
        except ValueError as exc:
            raise ConfigError(f"routing {name!r}: expected force_biased:STD with STD a number") from exc
        biased = force_biased_shares(num_layers, num_experts, top_k, std, seed=0)
        return lambda counts, seed: popularity_counts(counts, biased, seed, f"force-biased std {std}")
    raise ConfigError(f"routing {name!r}: expected 'popularity' or 'force_biased:STD'")


def simulate_pair(row: dict[str, Any], source: str, constants: tuple[str, ...] = ()) -> dict[str, float]:
    """The row's forced and dropless runs (module doc): their step seconds, the simulated and measured
    penalty and the dropless routing's mean skew. ``constants``: overrides after the row's (e.g.
    ``training.host_overhead_s=0.003589``, to price the pair with another host time)."""
    spec = row_config(row, constants)
    cluster, model = build_cluster(spec), build_model(spec)
    cost = build_cost(spec, cluster, model)
    blank = SampleCounts(
        counts=np.zeros(
            (int(spec.trace.samples_per_batch), model.num_moe_layers, model.num_experts), np.int32
        ),
        tokens=np.full(int(spec.trace.samples_per_batch), int(row["config"]["seq_len"]), dtype=np.int64),
        batch_offsets=np.array([0, int(spec.trace.samples_per_batch)], dtype=np.int64),
        top_k=model.top_k,
        meta={"source": "penalty check"},
    )
    route = routing_source(source, model.name, model.num_moe_layers, model.num_experts, model.top_k)
    out: dict[str, float] = {}
    for kind, counts in (
        ("forced", uniform_routing(blank, int(spec.seed))),
        ("dropless", route(blank, int(spec.seed))),
    ):
        counts, workload = row_workload(spec, counts)
        m = simulate(
            build_planner(spec), counts, workload, cluster, model, cost, sim_options(spec, False)
        ).metrics
        out[f"{kind}_step_s"] = float(m["step_time_s"])
        out[f"{kind}_skew"] = float(m["skew_mean"])
        out[f"{kind}_compute_s"] = float(m["t_compute_s"])
        out[f"{kind}_comm_s"] = float(m["t_comm_s"])
    out["penalty"] = out["dropless_step_s"] / out["forced_step_s"] - 1.0
    out["measured_penalty"] = measured_penalty(row)
    return out


def penalty_table(path: str | Path = DATA_FILE, sources: tuple[str, ...] = SOURCES) -> pd.DataFrame:
    """One line per (row, source): the simulated and measured penalty, their ratio, the skews and steps; a
    row with ``needs`` (what the simulator lacks for it) one line with its measured penalty only."""
    doc = load_penalty_rows(path)
    lines: list[dict[str, Any]] = []
    for row in doc["rows"]:
        if row.get("needs"):
            lines.append({"id": row["id"], "source": "", "measured_penalty": measured_penalty(row),
                          "needs": row["needs"]})  # fmt: skip
            continue
        for source in sources:
            sim = simulate_pair(row, source)
            lines.append({"id": row["id"], "source": source, **sim, "needs": "",
                          "penalty_ratio": sim["penalty"] / sim["measured_penalty"]})  # fmt: skip
    return pd.DataFrame(lines)


def implied_std(row: dict[str, Any], lo: float = 0.0, hi: float = 2.0, steps: int = 8) -> dict[str, float]:
    """The force-biased std at which the simulated penalty equals the measured one (bisection over
    ``[lo, hi]``, the penalty growing with the std), with that routing's skew; ``std`` is NaN when even
    ``hi`` falls short (the penalty and skew at ``hi`` are then reported)."""
    target = measured_penalty(row)
    top = simulate_pair(row, f"force_biased:{hi}")
    if top["penalty"] < target:
        return {
            "std": float("nan"),
            "penalty": top["penalty"],
            "skew": top["dropless_skew"],
            "target": target,
        }
    best = top
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        sim = simulate_pair(row, f"force_biased:{mid}")
        if sim["penalty"] < target:
            lo = mid
        else:
            hi, best = mid, sim
    return {"std": hi, "penalty": best["penalty"], "skew": best["dropless_skew"], "target": target}
