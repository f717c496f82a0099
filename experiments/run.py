"""The suite's entry point: ``python -m experiments.run`` (console script ``relibra-run``).

``main`` only hands the composed config to :func:`run`, a plain function that tests call directly. A run:

1. :func:`~experiments.config.checks.check_config` refuses a bad config before any work (nothing is written,
   not even Hydra's ``.hydra/`` files, which are written here once the config is accepted);
2. builds cluster, model, cost model, planner; loads the trace (or generates it) and lays out the workload;
3. :func:`compute` simulates the planner -> one result row, the per-layer table and (if asked) the plans;
4. :func:`write_outputs` writes ``results.parquet``, ``summary.json``, ``per_layer.parquet`` and, with
   ``dump_plans=true``, ``plans.npz`` (README.md, "Plan dump"), each atomically (temp file + ``os.replace``),
   and removes an earlier run's files this run does not write; ``summary.json`` says why any is absent;
5. the logger (``logger=wandb``) sees only what is already on disk.

With ``results_dir`` set (experiment presets), steps 2-4 run only when the experiment's results store has
no finished cell of the same config (:func:`experiments.store.access.run_cell`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import hydra
import numpy as np
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.config.build import (
    build_cluster,
    build_cost,
    build_model,
    build_planner,
    dataset_name,
    planning,
    routing,
    sim_options,
)
from experiments.config.checks import check_config, writable_dir
from experiments.config.errors import ConfigError, refuse
from experiments.config.executor_check import executor_time_problem
from experiments.config.parallel_check import workload_memory_problems
from experiments.config.spec import RunSpec
from experiments.inputs import cell_inputs, replay_mismatch, trained_inputs
from experiments.store.access import run_cell, stored_code_version
from experiments.store.cell_files import CorruptCellError
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore
from experiments.store.run_dir import commit_run, remove_new_dirs
from experiments.sweep_check import FAILED_FILE, CellFailure
from relibra.atomic import atomic_write
from relibra.layout import unbalanceable_batches
from relibra.provenance import code_version
from relibra.simulator import CostModelExecutor, SimResult, simulate
from relibra.types import BatchPlan, SampleCounts, Workload

__all__ = ["adopt", "cli", "compute", "main", "plan_dump_arrays", "preflight", "run", "write_outputs"]


log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, the shell's convention)."""


def plan_dump_arrays(
    plans: Sequence[BatchPlan], counts: SampleCounts, workload: Workload, meta: dict[str, Any]
) -> dict[str, np.ndarray]:
    """The ``plans.npz`` arrays (README.md, "Plan dump") of a run's plans (one per batch, in order)."""
    sample_gpu = np.concatenate([p.sample_gpu for p in plans]).astype(np.int32)
    return {
        "home": np.stack([p.home for p in plans]).astype(np.int32),
        "sample_gpu": sample_gpu,
        "sample_mb": workload.sample_mb.astype(np.int32),
        "mb_batch": workload.mb_batch.astype(np.int32),
        "load": np.concatenate([p.load for p in plans]).astype(np.int32),
        "assign": np.concatenate([p.assign for p in plans]).astype(np.int32),
        "meta": np.array(json.dumps(meta, sort_keys=True)),
    }


def _trace_model(meta: dict[str, Any], model: str, path: str) -> str:
    """The model a trace file says it was recorded from (its ``meta.model``), warned about when it is not
    the run's model: the shapes agree (validated), but the routing is another model's."""
    recorded = str(meta.get("model"))
    if recorded != model:
        log.warning(
            "trace.path=%s was recorded from model %s, not the run's model=%s (same shape, another model's "
            "routing); the results record it in column trace_model", path, recorded, model,
        )  # fmt: skip
    return recorded


def _foreign_experts(plan: BatchPlan) -> int:
    """Most non-home experts one GPU computes in any (micro-batch, layer) of ``plan`` (0 when none)."""
    g = plan.assign.shape[-1]
    non_home = (plan.assign > 0) & (plan.home[None, :, :, None] != np.arange(g))  # [Mb, L, E, G]
    return int(non_home.sum(axis=2).max(initial=0))


def compute(spec: RunSpec) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, np.ndarray] | None]:
    """Simulate a checked run spec (:func:`~experiments.config.checks.check_config` returns one) -> (results
    [1 row], per-layer table, plan-dump arrays or None). Writes nothing."""
    cluster, model = build_cluster(spec), build_model(spec)
    model.check_ep(cluster)
    cost = build_cost(spec, cluster, model)
    log.info("%s", cost.parallel.describe(cluster.num_gpus, cluster.gpus_per_node))
    planner = build_planner(spec)
    executor = (
        CostModelExecutor(cost)
        if spec.executor.name == "sim"
        else hydra.utils.instantiate(spec.executor.node(), _convert_="all")
    )
    counts, workload = cell_inputs(spec, cluster.num_gpus)  # NOTE: memoised per process, read-only
    if memory := workload_memory_problems(spec, cost, workload.tokens, workload.mb_batch):
        raise ConfigError(memory[0])  # NOTE: needs the workload's micro-batches; still before planning
    slow = executor_time_problem(spec, workload.load, cluster.num_gpus)
    if slow is not None:  # NOTE: needs the workload's token counts; still before planning and any process
        raise ConfigError(slow)
    short = unbalanceable_batches(counts.batch_offsets, cluster.num_gpus)
    if short:
        log.warning(
            "%d of %d batches have fewer samples than the %d GPUs: some GPUs idle in them (results column "
            "unbalanceable_batches)", short, counts.num_batches, cluster.num_gpus,
        )  # fmt: skip
    if cluster.ep_overlap:
        fewest = min(int(workload.batch_microbatches(b).size) for b in range(counts.num_batches))
        if fewest < 2:
            raise ConfigError(
                f"cluster.ep_overlap=true needs at least 2 micro-batches per batch to overlap; this "
                f"workload's layout gives {fewest} (raise trace.samples_per_batch or lower "
                "workload.samples_per_microbatch / workload.tokens_per_microbatch)"
            )
    keep = spec.dump_plans or not isinstance(executor, CostModelExecutor)
    trained = trained_inputs(spec, cluster.num_gpus)  # NOTE: None under exact replay (replay.mismatch=0)
    with planning(spec, planner, cluster, model, cost) as planned:
        result: SimResult = simulate(
            planned, counts, workload, cluster, model, cost, sim_options(spec, keep), trained
        )
    row: dict[str, Any] = {
        "model": model.name,
        "dataset": dataset_name(spec, counts),
        "planner": result.planner,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "nvl_domain": cluster.domain_gpus,
        "replica_slots": planner.slot_budget.replica_slots,
        "tokens": float(counts.tokens.sum()) / max(counts.num_batches, 1),
        "executor": spec.executor.name,
        "trace": spec.trace.path if spec.trace.path else f"synthetic:{spec.trace.preset}",
        "num_batches": counts.num_batches,
        "layout": spec.workload.layout,
        "routing": routing(spec),
        "replay_mismatch": replay_mismatch(spec),
        "unbalanceable_batches": short,
        "seed": spec.seed,
        "code_version": code_version(),
        **result.metrics,
    }
    if spec.trace.path:
        row["trace_model"] = _trace_model(counts.meta, model.name, spec.trace.path)
    if result.plans and not isinstance(executor, CostModelExecutor):
        report = executor.execute(result.plans, model, cluster)
        row["executor_moe_time_s"] = float(np.sum(report.moe_time_s)) / max(counts.num_batches, 1)
        row.update({f"executor_{k}": v for k, v in report.extra.items()})
    dump = None
    if spec.dump_plans and result.plans:
        meta = {
            "planner": result.planner,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "nvl_domain": cluster.domain_gpus,
            # NOTE: a method without fixed slots (LLEP) is dumped with the most foreign experts a GPU held.
            "replica_slots": max(
                [row["replica_slots"]] + [_foreign_experts(p) for p in result.plans if p.online]
            ),
            "redundant_slots": planner.slot_budget.redundant_slots,
            "num_experts": model.num_experts,
            "num_layers": counts.num_layers,
            "top_k": counts.top_k,
            "trace": row["trace"],
            "model": model.name,
            "replicas_in_home_node": planner.slot_budget.replicas_in_home_node,
            "routing": routing(spec),
            "layout": spec.workload.layout,
        }
        dump = plan_dump_arrays(result.plans, counts, workload, meta)
    return pd.DataFrame([row]), result.per_layer(), dump


def write_outputs(
    run_dir: Path,
    results: pd.DataFrame,
    per_layer: pd.DataFrame | None,
    dump: dict[str, np.ndarray] | None,
    not_written: dict[str, str] | None = None,
    reused_from: str | None = None,
    hydra_files: dict[str, bytes] | None = None,
) -> None:
    """Replace ``run_dir``'s run files by this run's, as a whole or not at all (:func:`commit_run`).

    ``summary.json`` is ``{"rows": [...], "files": [...], "not_written": {file: why}, "reused_from": path
    or null}``: the result rows, the files this run wrote, why any other run file is absent (e.g. a cell
    read back from the results store has no plans) and the store file the rows were read back from
    (null: computed by this run). ``hydra_files``: Hydra's ``.hydra/*.yaml`` of this run (relative name ->
    text), committed with the rest. Files of an earlier run in ``run_dir`` that this run does not write
    are removed.
    """
    files: dict[str, Callable[[BinaryIO], object]] = {}
    written = ["results.parquet", "summary.json"]
    if per_layer is not None:
        files["per_layer.parquet"] = lambda f: per_layer.to_parquet(f, index=False)
        written.append("per_layer.parquet")
    if dump is not None:
        files["plans.npz"] = lambda f: np.savez(f, **dump)  # type: ignore[arg-type]
        written.append("plans.npz")
    absent = {name: why for name, why in (not_written or {}).items() if name not in written}
    summary = {
        "rows": results.to_dict(orient="records"),
        "files": sorted(written),
        "not_written": absent,
        "reused_from": reused_from,
    }
    text = (json.dumps(summary, indent=2, default=float) + "\n").encode()
    files["summary.json"] = lambda f: f.write(text)
    files["results.parquet"] = lambda f: results.to_parquet(f, index=False)
    for name, data in (hydra_files or {}).items():
        files[name] = lambda f, data=data: f.write(data)  # type: ignore[misc]
    commit_run(run_dir, files)


def _not_written(spec: RunSpec, reused_from: str | None, has_per_layer: bool) -> dict[str, str]:
    """Why a run file is absent (see :func:`write_outputs`)."""
    why: dict[str, str] = {}
    if not spec.dump_plans:
        why["plans.npz"] = "dump_plans=false"
    elif reused_from is not None:
        why["plans.npz"] = (
            f"cell reused from the results store {reused_from}, which keeps no plans; rerun with "
            "recompute (python -m experiments.reproduce --recompute-stale, or delete the cell) to dump them"
        )
    else:
        why["plans.npz"] = "the planner is a bound (an ideal), not a plan"
    if not has_per_layer:
        why["per_layer.parquet"] = (
            f"cell reused from the results store {reused_from}, which holds no readable one for it"
        )
    return why


def _hydra_files(spec: RunSpec) -> dict[str, bytes]:
    """Hydra's ``.hydra/{config,hydra,overrides}.yaml`` of this run (empty outside a Hydra app).

    NOTE: Hydra writes these files itself before it calls the task function, so a refused or failed run
    would overwrite those of the run already in the directory; ``hydra.output_subdir`` is null in
    config.yaml and they are committed here with the run's other files (:func:`write_outputs`) instead.
    """
    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.get()
    texts = {
        ".hydra/config.yaml": OmegaConf.to_yaml(OmegaConf.create(dict(spec.composed))),
        ".hydra/hydra.yaml": OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})),
        ".hydra/overrides.yaml": OmegaConf.to_yaml(hydra_cfg.overrides.task),
    }
    return {name: text.encode() for name, text in texts.items()}


def _per_layer_of(store: ResultsStore, key: str) -> pd.DataFrame | None:
    """Cell ``key``'s stored per-layer table; None (logged) when it has none or it is unreadable."""
    try:
        return store.read_per_layer(key)
    except CorruptCellError as exc:  # the rows are whole; only their per-layer table is lost
        log.warning("%s", exc)
        return None


def _write_read_back(
    out: Path, spec: RunSpec, results: pd.DataFrame, per_layer: pd.DataFrame | None, source: Path
) -> None:
    """The run files of a cell read back from the store file ``source`` (no plans)."""
    reused_from = str(source)
    not_written = _not_written(spec, reused_from, per_layer is not None)
    write_outputs(out, results, per_layer, None, not_written, reused_from, _hydra_files(spec))


def adopt(spec: RunSpec, run_dir: str | Path, source: str | Path) -> pd.DataFrame:
    """Store the cell of ``spec`` from the results store ``source``, where the same cell is finished.

    For a grid runner whose presets share cells: the same :func:`~experiments.store.keys.cell_key` means the
    same resolved config apart from where results go (``IGNORED_KEYS``), hence the same computation, so
    the finished cell's rows and per-layer table are written into ``spec.results_dir``'s store (with
    ``spec.composed`` as the stored config) instead of being computed again. The run directory gets the run
    files with ``reused_from`` naming the source cell file. Returns the rows. Raises FileNotFoundError when
    ``source`` has no such finished cell, ConfigError when ``spec`` has no ``results_dir``.
    """
    if not spec.results_dir:
        raise ConfigError("adopt needs results_dir: the store the cell is copied into")
    key = cell_key(spec.composed)
    origin = ResultsStore(Path(str(source)))
    results = origin.read(key)
    store = ResultsStore(Path(spec.results_dir))
    per_layer = _per_layer_of(origin, key)
    with store.claim(key):
        store.write(key, results, spec.composed, per_layer)
    _write_read_back(Path(str(run_dir)), spec, results, per_layer, origin.cell_path(key))
    return results


def run(
    cfg: DictConfig | RunSpec, run_dir: str | Path | None = None, recompute: bool = False
) -> pd.DataFrame:
    """Run one config end to end and return its results (one row per planner run).

    ``run_dir``: where files go; default Hydra's output directory inside an app, else the config's
    ``run_dir`` or the current directory. With ``results_dir`` set, the run is one cell of an experiment's
    :class:`~experiments.store.results_store.ResultsStore`: a finished cell (same config hash) is read back
    instead of computed again (``recompute``: computed anyway, e.g. a cell finished by other code). Raises
    :class:`~experiments.config.errors.ConfigError` before any work on a bad config, an unreadable trace or a
    results directory that cannot be written. ``cfg``: the composed config, checked here once
    (:func:`~experiments.config.checks.check_config`, which builds its run spec), or a run spec checked
    already (a grid cell's, checked when its grid was planned, :func:`experiments.grid.runner.plan_grid`),
    which is checked nowhere here.
    """
    spec = cfg if isinstance(cfg, RunSpec) else check_config(cfg)
    if run_dir is None:
        run_dir = spec.run_dir or (HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else ".")
    out = Path(str(run_dir))
    store = ResultsStore(Path(spec.results_dir)) if spec.results_dir else None
    if store is not None:
        try:
            store.check_writable()
        except PermissionError as exc:
            raise ConfigError(str(exc)) from exc
    if why := writable_dir("hydra.run.dir" if HydraConfig.initialized() else "run_dir", str(out)):
        raise ConfigError(why)
    per_layer: pd.DataFrame | None = None

    def cell() -> tuple[pd.DataFrame, pd.DataFrame]:
        nonlocal per_layer
        results, per_layer, dump = compute(spec)
        write_outputs(out, results, per_layer, dump, _not_written(spec, None, True), None, _hydra_files(spec))
        return results, per_layer

    reused = False
    if store is not None:
        results, reused = run_cell(store, spec.composed, cell, recompute)
        if reused:  # NOTE: the run directory still gets the (stored) rows, so every run dir is complete.
            key = cell_key(spec.composed)
            stored = stored_code_version(results)
            if stored != code_version():
                log.warning(
                    "cell %s of %s was computed by code %s, not the current %s; delete it or use "
                    "`python -m experiments.reproduce --recompute-stale` to recompute it",
                    key, spec.results_dir, stored, code_version(),
                )  # fmt: skip
            per_layer = _per_layer_of(store, key)
            _write_read_back(out, spec, results, per_layer, store.cell_path(key))
    else:
        results, _ = cell()
    if spec.logger.name == "wandb" and not reused:  # a reused cell was logged when it ran
        from experiments.tracking.wandb_logger import log_run

        log_run(spec.logger, dict(spec.composed), results, per_layer, str(out))
    return results


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> CellFailure | None:
    """The Hydra app: compose, then :func:`run`. A bad config exits with status 2 and one message; a write
    error (a full disk) is one line naming the file, exit status 1. In a sweep, a cell that fails is one
    line and a :class:`~experiments.sweep_check.CellFailure` (the sweep goes on and ends with a summary of
    every failed cell, :mod:`experiments.sweep_check`)."""
    try:
        results = run(cfg)
    except ConfigError as exc:
        if HydraConfig.initialized() and not _in_sweep():  # NOTE: a refusal that needed the built inputs
            remove_new_dirs({f"{HydraConfig.get().job.name}.log"})
        refuse(exc)
    except Exception as exc:
        if not _in_sweep():
            if isinstance(exc, OSError):
                print(f"relibra-run: {exc}", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            raise
        return _cell_failed(exc)
    cols = ["planner", "model", "dataset", "step_time_s", "throughput_tokens_per_s", "skew_mean", "skew_max"]
    print(results[[c for c in cols if c in results]].to_string(index=False))
    if _in_sweep():  # NOTE: a failure record of an earlier sweep into this folder no longer holds
        (Path(HydraConfig.get().runtime.output_dir) / FAILED_FILE).unlink(missing_ok=True)
    return None


def _in_sweep() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _cell_failed(exc: Exception) -> CellFailure:
    """The sweep cell's failure: printed as one line, recorded in its folder when that can be written."""
    hydra_cfg = HydraConfig.get()
    cell = " ".join(hydra_cfg.overrides.task)
    why = " ".join(f"{type(exc).__name__}: {exc}".split())
    print(f"relibra-run: cell {hydra_cfg.job.num} ({cell}) failed: {why}", file=sys.stderr, flush=True)
    record = json.dumps({"cell": cell, "error": why}).encode()
    try:
        atomic_write(Path(hydra_cfg.runtime.output_dir) / FAILED_FILE, lambda f: f.write(record))
    except OSError:
        pass  # NOTE: the folder may be what failed (a full disk); the in-process summary still has it
    return CellFailure(cell, why)


def cli(argv: Sequence[str] | None = None) -> None:
    """``python -m experiments.run`` / ``relibra-run``: :func:`preflight` on the command line, then the
    Hydra app (:func:`main`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        try:
            preflight(args)
        except ConfigError as exc:
            refuse(exc)
        main()
    except KeyboardInterrupt:
        print(
            "relibra-run: interrupted; kept: every finished store cell and the run directory as it was "
            "(a run's files are committed only when it ends); the cell in progress was not stored",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_INTERRUPTED) from None


SLURM_LAUNCHERS = ("slurm", "submitit_slurm")
"""``hydra/launcher`` options that submit to a Slurm controller."""

SLURM_PING_TIMEOUT_S = 15.0
"""How long ``scontrol ping`` may take before the controller counts as not answering (Slurm's own
``MessageTimeout`` default is 10 s)."""


def _slurm_problem(launcher: str) -> str | None:
    """Why ``hydra/launcher=<launcher>`` cannot submit from here (None: a controller answers)."""
    start = "start the local test cluster with `sudo slurm/start.sh` (docs/slurm.md) or run where Slurm is"
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return f"hydra/launcher={launcher}: no Slurm client commands (sbatch, scontrol) on PATH; {start}"
    try:
        ping = subprocess.run(
            ["scontrol", "ping"], capture_output=True, text=True, timeout=SLURM_PING_TIMEOUT_S
        )
    except (subprocess.TimeoutExpired, OSError) as err:
        return f"hydra/launcher={launcher}: no Slurm controller answers (scontrol ping: {err}); {start}"
    if ping.returncode != 0 or " UP" not in ping.stdout:
        said = " ".join((ping.stdout + ping.stderr).split()) or f"exit status {ping.returncode}"
        return f"hydra/launcher={launcher}: no Slurm controller answers (scontrol ping: {said}); {start}"
    return None


def _sweep_in_run_problems(overrides: Sequence[str]) -> list[str]:
    """A sweep (``seed=1,2``) outside ``--multirun``, which Hydra refuses with a multi-line message."""
    from experiments.config.schema import parse_problems

    _, parsed = parse_problems(overrides)
    return [
        f"{o.input_line}: a sweep runs only with --multirun (-m); for a list write "
        f"{o.key_or_group}=[...], for a string quote the value"
        for o in parsed
        if o.is_sweep_override() and not o.key_or_group.startswith("hydra")
    ]


def _compose_problems(config_name: str, overrides: Sequence[str]) -> list[str]:
    """What Hydra refuses while composing (a key of a group option not chosen, ``logger.project=x`` without
    ``logger=wandb``; a value of the wrong type), which it prints on several lines with exit status 1:
    here one problem, its message folded onto one line."""
    import yaml
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from experiments.config.presets import CONF_DIR
    from experiments.config.schema import yaml_problem

    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name=config_name, overrides=list(overrides))
    except yaml.YAMLError as exc:
        return [yaml_problem(exc)]
    except (HydraException, OmegaConfBaseException) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = " ".join(line for line in lines if not line.startswith(("full_key:", "object_type=", "See ")))
        return [text or type(exc).__name__]
    return []


def _sweep_yaml_problems(config_name: str, overrides: Sequence[str]) -> list[str]:
    """The malformed config file a cell of a sweep chooses, if any (composed only when the config schema
    found one: :attr:`experiments.config.schema.ConfigSchema.broken`)."""
    from experiments.config.presets import expand

    for cell in expand({}, overrides):
        if found := [p for p in _compose_problems(config_name, cell) if "not valid YAML" in p]:
            return found
    return []


HYDRA_FLAGS = (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
               ("--multirun", "-m"), ("--shell-completion", "-sc"))  # fmt: skip
"""Hydra 1.3's command-line switches (``python -m experiments.run --hydra-help``; Hydra's own parser,
``hydra._internal.utils.get_args_parser``, is not public API)."""
HYDRA_OPTIONS = (("--cfg", "-c"), ("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"),
                 ("--config-dir", "-cd"), ("--experimental-rerun",))  # fmt: skip
"""Hydra 1.3's command-line options that take a value (``--info`` takes an optional one)."""


def _args_parser() -> argparse.ArgumentParser:
    """The command line the Hydra app takes (:data:`HYDRA_FLAGS`, :data:`HYDRA_OPTIONS`, ``--info``, the
    overrides), read here before Hydra reads it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("overrides", nargs="*")
    for flags in HYDRA_FLAGS:
        parser.add_argument(*flags, action="store_true")
    for flags in HYDRA_OPTIONS:
        parser.add_argument(*flags)
    parser.add_argument("--info", "-i", nargs="?", const="all")
    return parser


def preflight(args: Sequence[str]) -> None:
    """Refuse, before Hydra composes anything, what Hydra would refuse with a traceback and exit status 1
    or silently accept: an unknown group option (``planner=bogus``), a misspelt key
    (``planner.replica_slot=2``), a ``+key`` that no code reads, an output directory that cannot be
    written. Raises one :class:`ConfigError` naming each key and the closest known one
    (:func:`experiments.config.schema.override_problems`)."""
    from experiments.config.schema import config_schema, override_problems

    known, stray = _args_parser().parse_known_args(list(args))
    if known.help or known.hydra_help or known.version or known.info or known.shell_completion or known.cfg:
        return  # NOTE: Hydra's own help and inspection modes run no task
    if stray:  # NOTE: Hydra's argparse would print its usage and this on several lines
        raise ConfigError(
            f"unrecognized arguments {' '.join(stray)}: give options (-m, --cfg, ...) before the overrides"
        )
    problems = override_problems(known.overrides)
    if not known.multirun:
        problems += _sweep_in_run_problems(known.overrides)
    key = "hydra.sweep.dir" if known.multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in known.overrides if o.lstrip("+").split("=", 1)[0] == key]
    target = given[-1] if given else ("multirun" if known.multirun else "outputs")
    if not target.strip():  # NOTE: an unset shell variable; Hydra would write into the current directory
        problems.append(f"{key}={target!r}: empty; give the folder the run's files go to")
    elif "${" not in target and (why := writable_dir(key, target)):
        problems.append(why)
    if known.multirun and not problems and config_schema().broken:
        problems += _sweep_yaml_problems(known.config_name or "config", known.overrides)
    if not known.multirun and not (known.config_path or known.config_dir):
        composed = _compose_problems(known.config_name or "config", known.overrides)
        if any("not valid YAML" in p for p in composed):
            problems = composed  # NOTE: a malformed file this run chooses; the key checks read its keys
        elif not problems:
            problems = composed
    launchers = [o.split("=", 1)[1] for o in known.overrides if o.split("=", 1)[0] == "hydra/launcher"]
    if launchers and launchers[-1] in SLURM_LAUNCHERS and (why := _slurm_problem(launchers[-1])):
        problems.append(why)
    if problems:
        raise ConfigError("bad configuration: " + "; ".join(problems))


if __name__ == "__main__":
    cli()
