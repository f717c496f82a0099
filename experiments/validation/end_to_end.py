"""The whole simulated step beside published end-to-end training runs: ``python -m experiments.validate
--end-to-end``.

Each row of ``experiments/data/end_to_end.json`` is one published measurement (source, URL at a commit,
date, the exact configuration, value, unit) with its role, ``calibration`` or ``check``, fixed before any
constant was set. The file's ``fitted_constants`` maps each constant fitted to published end-to-end numbers
to the rows it was fitted to; only ``calibration`` rows may appear there (:func:`check_roles`), and the
model's value of a row is computed from its configuration alone (:func:`simulate_row`: the published value
is never read), which ``tests/experiments/test_end_to_end.py`` checks by perturbing every check value.

A row is simulated as its run was measured: force-balanced routing (uniform top-k, Megatron's static
placement; the tables' footnote), ``global_batch`` samples of exactly ``seq_len`` tokens in one batch,
``micro_batch`` samples per TP x CP group per micro-batch (Megatron's micro-batch: ``GBS / (MBS * data
parallel)`` micro-batches a step, each GPU routing ``1 / (tp * cp)`` of its group's tokens), the whole step
(``simulator.step=whole``), the row's ``overrides`` (model, cluster, precision, dispatcher, recompute,
parallel dimensions). Rows with PP, TP or CP give their parallel dimensions as ``parallel.*`` overrides:
tokens/s/GPU is then the pipeline's tokens over its ``pp * G`` GPUs. Rows with ``needs`` (something the
simulator does not have: a model) are listed and left out of the errors.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from baselines.force_balanced import uniform_routing
from experiments.config.build import build_cluster, build_cost, build_model, build_planner, sim_options
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.presets import CONF_DIR
from experiments.config.spec import RunSpec
from experiments.validation.data_files import DATA_DIR, read_rows_file
from relibra.simulator import simulate
from relibra.types import SampleCounts, Workload
from relibra.workload import parallel_workload

__all__ = [
    "ROLES",
    "check_roles",
    "end_to_end_table",
    "errors",
    "load_rows",
    "row_config",
    "row_workload",
    "simulate_row",
    "unfitted_overrides",
]

DATA_FILE = DATA_DIR / "end_to_end.json"
ROLES = ("calibration", "check")


def load_rows(path: str | Path = DATA_FILE) -> dict[str, Any]:
    """The end-to-end data file (format: module doc), its roles checked (:func:`check_roles`). Refuses a
    missing or unreadable file, and one without a ``rows`` list, naming the path."""
    doc = read_rows_file(path, "end-to-end data")
    check_roles(doc)
    return doc


def check_roles(doc: dict[str, Any]) -> None:
    """Refuse a file whose rows lack a role, or whose fitted constants (``{key: {"value": number, "rows":
    [ids], ...}}``) name a ``check`` row or no row, or lack a value."""
    roles = {}
    for row in doc["rows"]:
        if row.get("role") not in ROLES:
            raise ValueError(
                f"end-to-end row {row.get('id')!r}: role={row.get('role')!r}; expected one of {ROLES}"
            )
        roles[row["id"]] = row["role"]
    for constant, fit in (doc.get("fitted_constants") or {}).items():
        value = fit.get("value") if isinstance(fit, dict) else None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not isinstance(fit.get("rows"), list)
        ):
            raise ValueError(
                f"fitted constant {constant!r}: expected {{'value': number, 'rows': [row ids]}}, got {fit!r}"
            )
        for rid in fit["rows"]:
            if roles.get(rid) != "calibration":
                raise ValueError(
                    f"fitted constant {constant!r} uses row {rid!r}, whose role is {roles.get(rid)!r}: only "
                    "calibration rows may be fitted to"
                )


def unfitted_overrides(doc: dict[str, Any]) -> tuple[str, ...]:
    """Each of the file's fitted constants at 0, its value before any fit (``key=0.0``), in the file's
    order; empty if none. ``experiments/conf`` holds the fitted values (a test keeps them equal to the
    file's), so the model without these overrides is the fitted one."""
    return tuple(f"{key}=0.0" for key in (doc.get("fitted_constants") or {}))


def _counts(
    num_samples: int, seq_len: int, num_layers: int, num_experts: int, top_k: int, seed: int
) -> SampleCounts:
    """``num_samples`` samples of ``seq_len`` tokens in one batch, routed uniformly (force-balanced)."""
    blank = SampleCounts(
        counts=np.zeros((num_samples, num_layers, num_experts), dtype=np.int32),
        tokens=np.full(num_samples, seq_len, dtype=np.int64),
        batch_offsets=np.array([0, num_samples], dtype=np.int64),
        top_k=top_k,
        meta={"source": "end-to-end validation"},
    )
    return uniform_routing(blank, seed)


def _replicas(row: dict[str, Any]) -> int:
    """``parallel.dp`` of the row's overrides (1 when absent): the pipeline replicas the batch is split
    over."""
    for o in row["overrides"]:
        if o.startswith("parallel.dp="):
            return int(o.split("=", 1)[1])
    return 1


def _samples(row: dict[str, Any]) -> int:
    """Samples one EP group holds a part of per step: ``GBS / dp`` when its TP x CP groups nest in it (each
    of its ``G / (tp * cp)`` groups takes its share), ``GBS / dp * tp * cp / G`` when a TP x CP group spans
    ``tp * cp / G`` EP groups (they share its samples; :func:`relibra.parallel.ep_group_ranks`)."""
    conf = row["config"]
    n = int(conf.get("tp") or 1) * int(conf.get("cp") or 1)
    return int(conf["global_batch"]) // _replicas(row) * max(1, n // int(conf["ep"]))


def _micro_batch(conf: dict[str, Any]) -> int:
    """Samples per TP x CP group per micro-batch: the published micro-batch (Megatron's ``MBS``), held by the
    ``tp * cp`` GPUs of a group, each routing ``1 / (tp * cp)`` of its tokens (:mod:`relibra.workload`); a
    step then runs ``GBS / (MBS * data parallel)`` micro-batches
    (:func:`relibra.parallel.megatron_microbatches`)."""
    return int(conf["micro_batch"])


def row_config(row: dict[str, Any], constants: Sequence[str] = ()) -> RunSpec:
    """The row's composed and checked run spec (its overrides, then ``constants``, then the run's own keys:
    force-balanced, the whole step, the samples of ``seq_len`` tokens one EP group holds in one batch
    (:func:`_samples`), ``MBS`` samples
    per TP x CP group per micro-batch), its parallel dimensions checked against the row's ``config``."""
    conf = row["config"]
    overrides = [
        *row["overrides"],
        *constants,
        "planner=force_balanced",
        "simulator.step=whole",
        f"workload.samples_per_microbatch={_micro_batch(conf)}",
        f"trace.samples_per_batch={_samples(row)}",
        f"trace.max_tokens={int(conf['seq_len'])}",
        "trace.num_batches=1",
        "control_plane.enabled=false",
    ]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="end_to_end"):
        spec = check_config(compose("config", overrides=overrides))
    parallel, g = spec.parallel, spec.cluster.nodes * spec.cluster.gpus_per_node
    world = parallel.world_size(g)
    given = (world, g, parallel.pp, parallel.tp, parallel.cp)
    if given != (int(conf["gpus"]), int(conf["ep"]), *(int(conf.get(k) or 1) for k in ("pp", "tp", "cp"))):
        raise ValueError(
            f"row {row['id']}: the overrides give {world} GPUs at EP {g}, PP {parallel.pp}, "
            f"TP {parallel.tp}, CP {parallel.cp}; the run had {conf['gpus']} at EP {conf['ep']}, "
            f"PP {conf.get('pp')}, TP {conf.get('tp')}, CP {conf.get('cp')}"
        )
    return spec


def row_workload(spec: RunSpec, counts: SampleCounts) -> tuple[SampleCounts, Workload]:
    """The row's samples ``counts`` [S, L, E] as its TP x CP groups' ranks and their workload (what
    :func:`simulate_row` simulates; ``spec`` from :func:`row_config`)."""
    return parallel_workload(
        counts,
        spec.parallel,
        spec.cluster.nodes * spec.cluster.gpus_per_node,
        samples_per_microbatch=spec.workload.samples_per_microbatch,
        layout=spec.workload.layout,
        span=spec.model.attention_span,
    )


def simulate_row(row: dict[str, Any], constants: Sequence[str] = ()) -> dict[str, float]:
    """The simulated run of one row: tokens/s/GPU and the step's terms (seconds per step). Reads the row's
    ``config`` and ``overrides`` only, never its published ``value``; ``constants``: overrides applied after
    the row's (e.g. the fitted constants at 0, :func:`unfitted_overrides`)."""
    conf = row["config"]
    spec = row_config(row, constants)
    cluster, model = build_cluster(spec), build_model(spec)
    g, parallel = cluster.num_gpus, spec.parallel
    cost = build_cost(spec, cluster, model)
    counts = _counts(spec.trace.samples_per_batch, int(conf["seq_len"]), model.num_moe_layers,
                     model.num_experts, model.top_k, spec.seed)  # fmt: skip
    counts, workload = row_workload(spec, counts)
    result = simulate(build_planner(spec), counts, workload, cluster, model, cost, sim_options(spec, False))
    m = result.metrics
    # NOTE: the simulated batch is one pipeline replica's: its tokens pass through pp stages of G GPUs.
    out = {"model": m["throughput_tokens_per_s"] / (g * parallel.pp), "step_time_s": m["step_time_s"]}
    out.update({k: float(v) for k, v in m.items() if k.startswith("t_")})
    return out


def end_to_end_table(path: str | Path = DATA_FILE) -> pd.DataFrame:
    """One row per published measurement: published, model, ratio, role, whether it is simulated, and the
    simulated step's terms, all with the constants of ``experiments/conf`` (the fitted ones among them).
    With fitted constants in the file (``fitted_constants``), also ``model_unfitted`` and
    ``ratio_unfitted``: the row simulated with each of them at 0, as before the fit
    (:func:`unfitted_overrides`). The file's ``fitted_constants`` ride along in
    ``attrs["fitted_constants"]``."""
    doc = load_rows(path)
    unfitted = unfitted_overrides(doc)
    rows = []
    for row in doc["rows"]:
        conf = row["config"]
        parallelism = "pp/tp" if any(int(conf.get(k) or 1) > 1 for k in ("pp", "tp", "cp")) else "ep"
        base = {"id": row["id"], "role": row["role"], "parallelism": parallelism,
                "published": float(row["value"]), "unit": row["unit"]}  # fmt: skip
        if row.get("needs"):
            rows.append({**base, "model": float("nan"), "ratio": float("nan"), "needs": row["needs"]})
            continue
        sim = _simulated(row, path, ())
        out = {**base, **sim, "ratio": sim["model"] / float(row["value"]), "needs": ""}
        if unfitted:
            before = _simulated(row, path, unfitted)
            out.update(model_unfitted=before["model"], ratio_unfitted=before["model"] / float(row["value"]))
        rows.append(out)
    frame = pd.DataFrame(rows)
    frame.attrs["fitted_constants"] = doc.get("fitted_constants") or {}
    return frame


def _simulated(row: dict[str, Any], path: str | Path, constants: Sequence[str]) -> dict[str, float]:
    """:func:`simulate_row`, any failure one :class:`ConfigError` naming the file and the row."""
    try:
        return simulate_row(row, constants)
    except (ValueError, KeyError, TypeError, HydraException, OmegaConfBaseException) as exc:
        # NOTE: one message naming the file and the row, whatever part of its config is wrong.
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(f"end-to-end data {path}: row {row.get('id')!r}: {why}") from exc


def errors(table: pd.DataFrame, parallelism: str | None = None, column: str = "ratio") -> dict[str, float]:
    """Median and worst absolute relative error ``|model / published - 1|`` of the simulated check rows
    (``parallelism``: only the ``ep`` rows (EP alone) or the ``pp/tp`` rows (pipeline, tensor or context
    parallel besides); None: all; ``column``: ``ratio``, or ``ratio_unfitted`` for the model with the
    fitted constants at 0)."""
    check = table[(table.role == "check") & (table.needs == "")]
    if parallelism is not None:
        check = check[check.parallelism == parallelism]
    err = (check[column] - 1.0).abs().tolist()
    if not err:
        return {"rows": 0, "median": float("nan"), "worst": float("nan")}
    return {"rows": len(err), "median": float(statistics.median(err)), "worst": float(max(err))}
