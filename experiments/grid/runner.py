"""The main job's grid runner (library): each preset's cells planned against its results store, then
computed in worker processes, one per core, each cell once however many presets share it.

:func:`plan_grid` composes and checks a preset's cells (:mod:`experiments.config.presets`) and says which
are finished, stale or missing; :func:`schedule` groups the missing cells by trace so each worker's cache
(:mod:`experiments.inputs`) builds its counts and workload once; :func:`run_jobs` hands them to the workers
(``experiments.run.run`` computes each cell) and copies a shared cell's rows into the other presets'
stores. The command around it, ``python -m experiments.reproduce``: :mod:`experiments.grid.cli`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import (
    Progress,
)

from experiments.config.presets import cells, compose_cells
from experiments.config.spec import RunSpec
from experiments.grid.jobs import CellJob, CellOutcome, GridReport
from experiments.grid.progress import Bars, Lines, Tracker
from experiments.store.access import stored_code_version
from experiments.store.cell_files import CorruptCellError, GridFileError
from experiments.store.keys import cell_key, keyed_earlier
from experiments.store.results_store import ResultsStore
from relibra.provenance import code_version, identifies_code

__all__ = [
    "FIELD_PRESETS",
    "PAPER_PRESETS",
    "QUICK_FIELD_PRESETS",
    "QUICK_PRESETS",
    "SCALES",
    "CellJob",
    "CellOutcome",
    "GridReport",
    "copy_cell_job",
    "plan_grid",
    "plan_grids",
    "prepare_olmoe_trace",
    "run_cell_job",
    "run_grid",
    "run_jobs",
    "schedule",
]

PAPER_PRESETS = (
    "overall",
    "ablation",
    "ep_scaling",
    "datasets",
    "overhead",
    "real_trace",
)
"""The paper's six grids at its scale (4 RL steps of 512 rollouts; ``make reproduce-paper``)."""
FIELD_PRESETS = (
    "overall_deepep",
    "nvl72",
    "comm_sensitivity",
    "comm_sensitivity_overall",
    "peer",
)
"""The grids beyond the paper, at its scale (``make reproduce-field``): the overall comparison under DeepEP,
which production runs use (the headline figure's second row), rack-scale NVLink domains, how the
verdicts move with the dispatcher and the EP overlap, and Megatron-LM's token-imbalance workloads."""
QUICK_PRESETS = (
    "quick_overall",
    "quick_ablation",
    "quick_ep_scaling",
    "quick_datasets",
    "quick_overhead",
    "quick_real_trace",
)
"""The paper's six grids at the quick scale (``make reproduce``, the main job): the questions the paper
answers, in the fewest cell seconds. The grids beyond the paper are :data:`QUICK_FIELD_PRESETS`."""
QUICK_FIELD_PRESETS = (
    "quick_overall_deepep",
    "quick_nvl72",
    "quick_whole_step_shift",
    "quick_comm_sensitivity",
    "quick_peer",
)
"""The grids beyond the paper at the quick scale (``make reproduce-quick-field``), and two that are cheap
only there: the MoE-only vs whole-step shift (docs/validation.md) and the communication sensitivity of
``ep_scaling``. They hold most of the quick cell seconds (``quick_comm_sensitivity``'s ReLibra cells alone
about half: docs/records/reproduce-speed.md), so the main job leaves them out."""
SCALES = {
    "quick": QUICK_PRESETS,
    "quick-field": QUICK_FIELD_PRESETS,
    "paper": PAPER_PRESETS,
    "field": FIELD_PRESETS,
}
"""``--scale`` -> its presets."""
REPO = Path(__file__).resolve().parents[2]
SHARED_TRACES = Path(os.environ.get("RELIBRA_SHARED_TRACES", REPO.parent / "shared" / "traces"))
OLMOE_SAMPLES_PER_BATCH = 100
"""The 200 OLMoE prompts become 2 batches (RL steps) of 100 rollouts each."""


def prepare_olmoe_trace(shared: Path, out: Path) -> Path | None:
    """The OLMoE decode trace as a trace file at ``out`` (made once); None when ``shared`` lacks it."""
    if out.is_file():
        return out
    source = shared / "olmoe-decode"
    if not source.is_dir():
        return None
    from relibra.trace.format import save_trace
    from relibra.trace.importers import load_olmoe_decode

    out.parent.mkdir(parents=True, exist_ok=True)
    return save_trace(load_olmoe_decode(source, samples_per_batch=OLMOE_SAMPLES_PER_BATCH), out)


def plan_grid(
    preset: str,
    results_root: Path,
    overrides: list[str],
    recompute_stale: bool = False,
    extend_grid: bool = False,
) -> tuple[GridReport, list[CellJob]]:
    """Sort ``preset``'s cells into finished ones (counted in the report) and jobs still to compute.

    The store's ``grid.json`` becomes this grid's keys, or with ``extend_grid`` their union with the grid
    recorded before; finished cells of the earlier grid that the new one leaves out are counted in the
    report's ``left_out``.

    A finished cell computed by other code than the current one (its ``code_version``) is counted in
    ``stale`` and reused, or with ``recompute_stale`` becomes a job (its stored rows are replaced only when
    the new ones are written). An unreadable cell file counts as missing (listed in ``corrupt``) and
    becomes a job. A cell that cannot even be looked at is recorded as failed and the grid goes on.
    Raises, before anything is written: ValueError for an unknown preset, ConfigError when every cell's
    config is refused (:func:`_check_grid`: each distinct problem once), PermissionError when the
    store's folder cannot be written.
    """
    report = GridReport(preset)
    store_dir = results_root / preset
    store = ResultsStore(store_dir)
    grid = cells(preset, overrides)  # NOTE: overrides may sweep too (e.g. planner=megatron,relibra)
    configs = compose_cells(preset, [[*cell, f"results_dir={store_dir}"] for cell in grid])
    specs = _check_grid(preset, configs)
    store.check_writable()  # before any cell is computed: PermissionError naming the folder
    keys = {cell_key(cfg) for cfg in configs}
    try:
        store.grid_keys()
    except GridFileError as err:  # NOTE: with --extend-grid, write_grid refuses it below, before any work
        report.grid_replaced = err.reason
    before = store.write_grid(keys, extend=extend_grid)
    if not extend_grid:
        gone = sorted((before - keys) & set(store.keys()))
        report.rekeyed = sum(_keyed_earlier(store, key) for key in gone)
        report.left_out = len(gone) - report.rekeyed
    report.total = len(grid)
    jobs: list[CellJob] = []
    for cell, cfg, checked in zip(grid, configs, specs, strict=True):
        key = cell_key(cfg)
        try:  # NOTE: one cell that cannot be looked at must not cost the rest of the grid
            stored = _stored_version(store, key, report)
        except Exception as exc:
            report.failed.append((cell, f"{type(exc).__name__}: {exc}"))
            continue
        # NOTE: a version that names no code (``0.1.0``, ``unknown``) is never equal to the current one
        stale = stored is not None and (stored != code_version() or not identifies_code(stored))
        if stale and stored is not None:
            report.stale[stored] = report.stale.get(stored, 0) + 1
        if stored is not None and not (recompute_stale and stale):
            report.reused += 1
            continue
        run_dir = store_dir / "runs" / key
        jobs.append(CellJob(preset, cell, _label(cfg), checked, run_dir, stored is not None, key))
    return report, jobs


def plan_grids(
    plans: list[tuple[str, list[str]]],
    results_root: Path,
    recompute_stale: bool = False,
    workers: int = 1,
    extend_grid: bool = False,
) -> list[tuple[GridReport, list[CellJob]]]:
    """:func:`plan_grid` of each ``(preset, overrides)``, in the order given.

    Composing and checking a cell is serial work (about 15 ms to compose,
    :func:`experiments.config.presets.compose_cells`, and 40 ms to check on the 2-core development CPU,
    docs/records/reproduce-speed.md, so a few thousand cells take minutes), so with ``workers > 1`` the
    presets are planned in a pool of spawned processes, the largest grid first. The first preset that
    raises stops the planning (nothing is computed); its exception is raised here.
    """
    if workers <= 1 or len(plans) <= 1:
        return [
            plan_grid(preset, results_root, overrides, recompute_stale, extend_grid)
            for preset, overrides in plans
        ]
    sizes = [len(cells(preset, overrides)) for preset, overrides in plans]
    planned: list[tuple[GridReport, list[CellJob]] | None] = [None] * len(plans)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(workers, len(plans)), mp_context=ctx) as pool:
        futures = {
            pool.submit(plan_grid, plans[i][0], results_root, plans[i][1], recompute_stale, extend_grid): i
            for i in sorted(range(len(plans)), key=lambda i: -sizes[i])
        }
        try:
            for future in as_completed(futures):
                planned[futures[future]] = future.result()
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return [item for item in planned if item is not None]


def _label(cfg: DictConfig) -> str:
    """How progress lines name a composed cell (a refused one too): ``model dataset EPn planner``."""
    dataset = cfg.trace.get("dataset") or cfg.trace.preset
    ep = int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)
    return f"{cfg.model.name} {dataset} EP{ep} {cfg.planner.name}"


def _check_grid(preset: str, configs: list[DictConfig]) -> list[RunSpec | str]:
    """Check every cell's config once (:func:`~experiments.config.checks.check_config`), here, so that no
    worker checks it again: each cell's checked run spec, or its refusal as :func:`_why` words it.

    Refuse a grid none of whose cells can run before any runs: one ConfigError listing each distinct
    problem once (an override such as ``cluster.nodes=-1`` breaks every cell the same way), with how many
    cells it stops. A grid with some good cells runs them; its refused cells are reported as failed, each
    with its reason, when the grid ends (one bad cell must not cost the rest)."""
    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError

    problems: dict[str, int] = {}
    checked: list[RunSpec | str] = []
    for cfg in configs:
        try:
            checked.append(check_config(cfg))
        except ConfigError as exc:
            text = str(exc).removeprefix("bad configuration: ")
            problems[text] = problems.get(text, 0) + 1
            checked.append(_why(exc))
    if problems and sum(problems.values()) == len(configs):
        listed = "; ".join(f"{text} ({n} of {len(configs)} cells)" for text, n in problems.items())
        raise ConfigError(f"preset {preset}: bad configuration: {listed}")
    return checked


def _keyed_earlier(store: ResultsStore, key: str) -> bool:
    """Whether finished cell ``key`` was keyed by an earlier rule of the suite (its trace file's path, its
    peer trace folder: :func:`experiments.store.keys.keyed_earlier`); False when its file cannot be read."""
    try:
        return keyed_earlier(store.config(key), key)
    except (FileNotFoundError, CorruptCellError):
        return False


def _stored_version(store: ResultsStore, key: str, report: GridReport) -> str | None:
    """The ``code_version`` of a finished cell; None when it is missing or its file is unreadable."""
    try:
        return stored_code_version(store.read(key))
    except FileNotFoundError:
        return None
    except CorruptCellError as err:
        report.corrupt.append(str(err.path))
        return None  # counts as missing: computed again, and the new file replaces it


def run_cell_job(job: CellJob) -> CellOutcome:
    """Compute one cell into its store (in this process or a worker); a failure is returned, not raised.

    The cell's config was checked when its grid was planned (:func:`_check_grid`): a refused cell fails
    with that refusal and an accepted one runs without being checked again."""
    from experiments.inputs import cache_stats
    from experiments.run import run  # NOTE: imported late so that `--help` does not import every planner

    if isinstance(job.spec, str):
        return CellOutcome(0.0, job.spec)
    start = time.perf_counter()
    before = cache_stats()
    try:
        run(job.spec, run_dir=job.run_dir, recompute=job.recompute)
    except Exception as exc:  # NOTE: one bad cell must not cost the rest of the grid
        return CellOutcome(time.perf_counter() - start, _why(exc))
    after = cache_stats()
    return CellOutcome(
        time.perf_counter() - start,
        trace_generated=after.counts_misses > before.counts_misses,
        workload_built=after.workload_misses > before.workload_misses,
        read_back=_read_back(job.run_dir),
    )


def _read_back(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` read its cell back from the store instead of computing it (another
    sweep of the same store finished it meanwhile): its ``summary.json`` names the store file."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("reused_from") is not None
    except (OSError, ValueError, AttributeError):
        return False


def _why(exc: Exception) -> str:
    """One line: the exception's type and message (with its traceback printed under RELIBRA_DEBUG)."""
    if os.environ.get("RELIBRA_DEBUG"):
        traceback.print_exception(exc)
    why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {why}"


def copy_cell_job(source: CellJob, outcome: CellOutcome, job: CellJob) -> CellOutcome:
    """Store ``job``'s rows from ``source``, the identical cell (same key) of another preset, just run.

    A failed source fails ``job`` with the same reason; nothing is computed either way.
    """
    from experiments.run import adopt

    if outcome.error is not None:
        return CellOutcome(0.0, f"same cell as {source.preset}'s, which failed: {outcome.error}")
    start = time.perf_counter()
    if not (isinstance(job.spec, RunSpec) and isinstance(source.spec, RunSpec)):
        return CellOutcome(0.0, job.spec if isinstance(job.spec, str) else f"{source.preset}: {source.spec}")
    try:
        adopt(job.spec, job.run_dir, Path(str(source.spec.results_dir)))
    except Exception as exc:  # NOTE: one bad cell must not cost the rest of the grid
        return CellOutcome(time.perf_counter() - start, _why(exc))
    return CellOutcome(time.perf_counter() - start, copied_from=source.preset)


def schedule(jobs: list[CellJob]) -> tuple[list[CellJob], dict[str, list[CellJob]]]:
    """The jobs to compute, in the order to hand them out, and the duplicates of each (by cell key).

    Jobs with the same :attr:`CellJob.key` are the same computation (presets share cells, e.g. the
    overall comparison's ReLibra cells reappear in the ablation and overhead tables): the first is
    computed, the others are copied from it (:func:`copy_cell_job`). The computed jobs are grouped by
    trace (:func:`experiments.inputs.trace_key`), so that a worker's cache of counts serves consecutive
    cells; the largest groups (samples x layers x experts x cells) go first and, within a group, the
    cells that anneal most (:func:`_reorderings`), so the run ends on small cells and neither worker
    idles long waiting for the last one.
    """
    from experiments.inputs import trace_key

    first: dict[str, CellJob] = {}
    copies: dict[str, list[CellJob]] = {}
    for job in jobs:
        if job.key in first:
            copies.setdefault(job.key, []).append(job)
        else:
            first[job.key] = job
    groups: dict[tuple[object, ...], list[CellJob]] = {}
    for job in first.values():
        groups.setdefault(trace_key(job.spec) if isinstance(job.spec, RunSpec) else (), []).append(job)

    def work(group: list[CellJob]) -> int:
        spec = group[0].spec
        if not isinstance(spec, RunSpec):
            return 0
        size = spec.trace.num_batches * spec.trace.samples_per_batch
        return -size * spec.model.num_moe_layers * spec.model.num_experts * len(group)

    def within(job: CellJob) -> tuple[int, int, str]:
        if not isinstance(job.spec, RunSpec):
            return 0, 0, ""
        spec = job.spec
        ep = spec.cluster.nodes * spec.cluster.gpus_per_node
        return -_reorderings(spec.planner.node()), -ep, str(spec.planner.setting("routing", ""))

    ordered = [job for group in sorted(groups.values(), key=work) for job in sorted(group, key=within)]
    return ordered, copies


def _reorderings(tree: dict[str, Any]) -> int:
    """Annealing reorderers in a planner's config (its ``reorder`` nodes, candidates' included): the
    stage that dominates a cell's time (docs/records/reproduce.md), so the schedule's estimate of its
    length."""

    def count(node: object) -> int:
        if not isinstance(node, dict):
            return 0
        own = int(isinstance(node.get("reorder"), dict))
        return own + sum(count(value) for value in node.values())

    return count(tree)


def run_jobs(
    jobs: list[CellJob],
    workers: int,
    on_done: Callable[[CellJob, CellOutcome], None],
    warmed: bool = False,
) -> None:
    """Compute ``jobs``, ``workers`` at a time, calling ``on_done`` in this process as each one ends.

    Jobs that are the same cell (same key, several presets) are computed once and copied
    (:func:`schedule`). ``workers == 1`` computes them here, one after another. Otherwise independent
    cells run in a pool of spawned worker processes (``concurrent.futures``): each cell writes only its
    own store files (atomically), so the store needs no coordination; the numba cache is warmed first
    (:func:`experiments.grid.warmup.warming`; ``warmed``: the caller warmed it already, beside its planning).
    """
    from experiments.grid.warmup import warming

    todo, copies = schedule(jobs)

    def done(job: CellJob, outcome: CellOutcome) -> None:
        on_done(job, outcome)
        for twin in copies.get(job.key, []):
            on_done(twin, copy_cell_job(job, outcome, twin))

    if workers <= 1 or len(todo) <= 1:
        for job in todo:
            done(job, run_cell_job(job))
        return
    if not warmed:
        with warming(workers):
            pass
    # NOTE: one BLAS thread per worker, so that `workers` processes do not oversubscribe the cores; set
    # before the workers start (they inherit the environment), never in this process.
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    env = {k: os.environ.get(k) for k in _THREAD_VARS}
    os.environ.update({k: threads for k in _THREAD_VARS if k not in os.environ})
    try:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=ctx) as pool:
            # NOTE: the pool hands out jobs in submission order, so the schedule's order is kept.
            futures = {pool.submit(run_cell_job, job): job for job in todo}
            for future in as_completed(futures):
                job = futures[future]
                try:
                    outcome = future.result()
                except Exception as exc:  # NOTE: a worker that died (e.g. killed for memory)
                    outcome = CellOutcome(float("nan"), f"worker died: {type(exc).__name__}: {exc}")
                done(job, outcome)
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def run_grid(
    preset: str,
    results_root: Path,
    overrides: list[str],
    progress: Progress | None = None,
    recompute_stale: bool = False,
    workers: int = 1,
) -> GridReport:
    """Run every unfinished cell of ``preset`` into ``results_root/<preset>`` (see :func:`plan_grid`)."""
    report, jobs = plan_grid(preset, results_root, overrides, recompute_stale)
    tracker = Tracker(Lines(Console(width=160)) if progress is None else Bars(progress))
    tracker.add(report, len(jobs))
    run_jobs(jobs, workers, tracker.done)
    return report
