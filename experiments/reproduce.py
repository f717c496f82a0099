"""``make reproduce`` (``python -m experiments.reproduce``): the quick presets, then the paper's tables.

Runs every cell of the ``quick_*`` presets (Hydra's local flow: each cell is composed from its preset and
handed to ``experiments.run.run``), in worker processes, one per core (``--workers``), showing cells done,
cells left, cells reused and elapsed time. A cell that several presets share (same cell key) is computed
once and its rows copied into the other presets' stores; cells of one trace go to the workers one after
another, so each worker's cache (:mod:`experiments.inputs`) builds its counts and workload once.
Finished cells are kept in ``RESULTS/<preset>/`` by the results store, so a rerun only redoes what is
missing; finished cells that other code computed (their ``code_version``, see :mod:`relibra.provenance`)
are reported, and recomputed with ``--recompute-stale``. Then ``analysis`` prints the tables beside the
paper's numbers and writes them with the figures under ``RESULTS/analysis``.

``real_trace`` needs the OLMoE decode trace (``../shared/traces/olmoe-decode`` or ``RELIBRA_SHARED_TRACES``);
it is converted once to ``RESULTS/traces/olmoe-decode.npz`` and the preset is skipped when it is absent.

Examples::

    python -m experiments.reproduce                          # the quick presets (about 13 min on 2 cores)
    python -m experiments.reproduce --presets quick_ablation,quick_datasets
    python -m experiments.reproduce --scale paper            # the paper's six grids at its scale
    python -m experiments.reproduce --scale field            # the grids beyond the paper, at its scale
    python -m experiments.reproduce logger=wandb             # extra overrides go to every cell
    python -m experiments.reproduce planner=megatron,relibra # ... and may replace a preset's sweep
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import (
    Progress,
)

from experiments.grid import cells, compose_cells
from experiments.grid_jobs import CellJob, CellOutcome, GridReport
from experiments.peer_traces import is_peer_preset, prepare_peer_traces
from experiments.progress import Bars, Lines, Tracker, progress_bars, summarise
from experiments.store import (
    CorruptCellError,
    GridFileError,
    ResultsStore,
    cell_key,
    path_keyed,
    stored_code_version,
)
from relibra.provenance import code_version, code_version_note, identifies_code

__all__ = [
    "FIELD_PRESETS",
    "PAPER_PRESETS",
    "QUICK_PRESETS",
    "SCALES",
    "CellJob",
    "CellOutcome",
    "GridReport",
    "copy_cell_job",
    "main",
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
SCALES = {"paper": PAPER_PRESETS, "field": FIELD_PRESETS}
"""``--scale`` -> its presets (``quick``: :data:`QUICK_PRESETS`)."""
QUICK_PRESETS = (
    "quick_overall",
    "quick_overall_deepep",
    "quick_ablation",
    "quick_ep_scaling",
    "quick_nvl72",
    "quick_datasets",
    "quick_overhead",
    "quick_real_trace",
    "quick_whole_step_shift",
    "quick_comm_sensitivity",
    "quick_peer",
)
"""Every grid at the quick scale (``make reproduce``), and two that are cheap only there: the MoE-only vs
whole-step shift (docs/validation.md) and the communication sensitivity of ``ep_scaling``."""
REPO = Path(__file__).resolve().parents[1]
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
    config is refused (:func:`_validate_grid`: each distinct problem once), PermissionError when the
    store's folder cannot be written.
    """
    report = GridReport(preset)
    store_dir = results_root / preset
    store = ResultsStore(store_dir)
    grid = cells(preset, overrides)  # NOTE: overrides may sweep too (e.g. planner=megatron,relibra)
    configs = compose_cells(preset, [[*cell, f"results_dir={store_dir}"] for cell in grid])
    refusals = _validate_grid(preset, configs)
    store.check_writable()  # before any cell is computed: PermissionError naming the folder
    keys = {cell_key(cfg) for cfg in configs}
    try:
        store.grid_keys()
    except GridFileError as err:  # NOTE: with --extend-grid, write_grid refuses it below, before any work
        report.grid_replaced = err.reason
    before = store.write_grid(keys, extend=extend_grid)
    if not extend_grid:
        gone = sorted((before - keys) & set(store.keys()))
        report.rekeyed = sum(_path_keyed(store, key) for key in gone)
        report.left_out = len(gone) - report.rekeyed
    report.total = len(grid)
    jobs: list[CellJob] = []
    for cell, cfg, refusal in zip(grid, configs, refusals, strict=True):
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
        dataset = cfg.trace.get("dataset") or cfg.trace.preset
        label = f"{cfg.model.name} {dataset} EP{_ep(cfg)} {cfg.planner.name}"
        run_dir = store_dir / "runs" / key
        jobs.append(CellJob(preset, cell, label, cfg, run_dir, stored is not None, key, refusal))
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
    :func:`experiments.grid.compose_cells`, and 40 ms to check on the 2-core development CPU,
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


def _validate_grid(preset: str, configs: list[DictConfig]) -> list[str | None]:
    """Check every cell's config once (:func:`~experiments.config_checks.validate`), here, so that no
    worker checks it again: each cell's refusal as :func:`_why` words it (None: accepted).

    Refuse a grid none of whose cells can run before any runs: one ConfigError listing each distinct
    problem once (an override such as ``cluster.nodes=-1`` breaks every cell the same way), with how many
    cells it stops. A grid with some good cells runs them; its refused cells are reported as failed, each
    with its reason, when the grid ends (one bad cell must not cost the rest)."""
    from experiments.config import ConfigError
    from experiments.config_checks import validate

    problems: dict[str, int] = {}
    refusals: list[str | None] = []
    for cfg in configs:
        try:
            validate(cfg)
        except ConfigError as exc:
            text = str(exc).removeprefix("bad configuration: ")
            problems[text] = problems.get(text, 0) + 1
            refusals.append(_why(exc))
        else:
            refusals.append(None)
    if problems and sum(problems.values()) == len(configs):
        listed = "; ".join(f"{text} ({n} of {len(configs)} cells)" for text, n in problems.items())
        raise ConfigError(f"preset {preset}: bad configuration: {listed}")
    return refusals


def _path_keyed(store: ResultsStore, key: str) -> bool:
    """Whether finished cell ``key`` was keyed by its trace file's path (by the suite before content
    keys, :func:`experiments.store.path_keyed`); False when its file cannot be read."""
    try:
        return path_keyed(store.config(key))
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

    The cell's config was checked when its grid was planned (:func:`_validate_grid`): a refused cell fails
    with that refusal and an accepted one runs without being checked again."""
    from experiments.inputs import cache_stats
    from experiments.run import run  # NOTE: imported late so that `--help` does not import every planner

    if job.refusal is not None:
        return CellOutcome(0.0, job.refusal)
    start = time.perf_counter()
    before = cache_stats()
    try:
        run(job.cfg, run_dir=job.run_dir, recompute=job.recompute, checked=True)
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
    try:
        adopt(job.cfg, job.run_dir, Path(str(source.cfg.results_dir)))
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
        groups.setdefault(trace_key(job.cfg), []).append(job)

    def work(group: list[CellJob]) -> int:
        cfg = group[0].cfg
        size = int(cfg.trace.num_batches) * int(cfg.trace.samples_per_batch)
        return -size * int(cfg.model.num_moe_layers) * int(cfg.model.num_experts) * len(group)

    def within(job: CellJob) -> tuple[int, int, str]:
        return -_reorderings(job.cfg.planner), -_ep(job.cfg), str(job.cfg.planner.get("routing", ""))

    ordered = [job for group in sorted(groups.values(), key=work) for job in sorted(group, key=within)]
    return ordered, copies


def _reorderings(planner: DictConfig) -> int:
    """Annealing reorderers in a planner's config (its ``reorder`` nodes, candidates' included): the
    stage that dominates a cell's time (docs/records/reproduce.md), so the schedule's estimate of its
    length."""
    tree = OmegaConf.to_container(planner, resolve=False)

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
    (:func:`experiments.warmup.warming`; ``warmed``: the caller warmed it already, beside its planning).
    """
    from experiments.warmup import warming

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


def _ep(cfg: DictConfig) -> int:
    return int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(prog="python -m experiments.reproduce", description=__doc__.splitlines()[0])
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every cell (e.g. logger=wandb)"
    )
    parser.add_argument(
        "--results", type=Path, default=Path("results"), help="results root (default results/)"
    )
    parser.add_argument(
        "--presets",
        default=None,
        help="comma-separated presets to run, in order (default: those of --scale)",
    )
    parser.add_argument(
        "--scale",
        choices=("quick", *SCALES),
        default="quick",
        help="quick: every grid at the quick scale (default); paper: the paper's six grids at its scale; "
        "field: the grids beyond the paper (DeepEP, NVL72, dispatcher and overlap sensitivity) at its scale",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=os.cpu_count() or 1,
        help="cells computed at once, each in its own process (default: one per core; 1: in this process)",
    )
    parser.add_argument("--no-analysis", action="store_true", help="only run the cells")
    parser.add_argument(
        "--extend-grid",
        action="store_true",
        help="add this run's cells to each preset's recorded grid instead of replacing it (e.g. seed=1,2 "
        "beside a finished seed 0: the analysis then reads all three seeds)",
    )
    parser.add_argument(
        "--recompute-stale",
        action="store_true",
        help="recompute finished cells whose results came from other code (their code_version)",
    )
    args = parser.parse_args(argv)
    args.command = " ".join(
        ["python -m experiments.reproduce", *(argv if argv is not None else sys.argv[1:])]
    )
    # NOTE: tables are wide; when output is not a terminal (CI logs, files) rich would assume 80 columns.
    tty = sys.stdout.isatty()
    console = Console() if tty else Console(width=160)
    presets = (
        args.presets
        if args.presets is not None
        else ",".join(QUICK_PRESETS if args.scale == "quick" else SCALES[args.scale])
    )
    from experiments.config import ConfigError
    from experiments.grid import presets as known_presets
    from experiments.schema import override_problems

    try:
        chosen = [p.strip() for p in presets.split(",") if p.strip()]
        problems = _argument_problems(
            args.presets, chosen, args.overrides, known_presets(), override_problems
        )
        if problems:  # NOTE: before any folder is made
            print(f"python -m experiments.reproduce: {'; '.join(problems)}", file=sys.stderr)
            return 2
        return _reproduce(args, chosen, console, tty)
    except KeyboardInterrupt:
        print(
            "python -m experiments.reproduce: interrupted; kept: every cell finished so far (each is stored "
            "whole when it ends); a rerun computes only the rest",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    except ConfigError as exc:
        print(f"python -m experiments.reproduce: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, the shell's convention)."""


RESERVED_KEYS = {
    "experiment_name": "each preset sets its own experiment_name (its results folder and tables are found "
    "by it); choose presets with --presets",
    "experiment": "the presets are chosen with --presets",
    "results_dir": "each preset's store is RESULTS/<preset>; choose the results root with --results",
}
"""Keys the runner sets for every cell itself, so an override of them is refused (it would be ignored)."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse with its refusal on one line (its own prints the usage first), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def _argument_problems(
    given: str | None,
    chosen: list[str],
    overrides: list[str],
    known: list[str],
    override_problems: Callable[[list[str]], list[str]],
) -> list[str]:
    """What :func:`main` refuses before any folder is made: ``--presets`` naming no preset or an unknown one,
    an override that sets ``experiment_name`` (each preset sets its own, and the analysis picks the preset's
    tables by it), and the overrides :func:`experiments.schema.override_problems` refuses."""
    problems: list[str] = []
    if given is not None and not chosen:
        problems.append(f"--presets {given!r}: no preset given (choose from {', '.join(known)})")
    problems += [
        f"--presets {p}: no such preset (choose from {', '.join(known)})" for p in chosen if p not in known
    ]
    problems += [f"--presets names {p} twice" for p in sorted({p for p in chosen if chosen.count(p) > 1})]
    problems += [
        f"{o}: {RESERVED_KEYS[key]}"
        for o in overrides
        if (key := o.lstrip("+~").split("=", 1)[0].split("@", 1)[0]) in RESERVED_KEYS
    ]
    problems += override_problems(overrides)
    if not problems:
        problems += _yaml_problems(chosen, overrides)
    return problems


def _yaml_problems(chosen: list[str], overrides: list[str]) -> list[str]:
    """The malformed config files (:attr:`experiments.schema.ConfigSchema.broken`) that a chosen preset's
    cells use, one problem each naming the preset and the file; a malformed file no chosen preset uses
    is left alone. Composes the cells only when the config schema found such a file."""
    import yaml

    from experiments.schema import config_schema, yaml_problem

    if not config_schema().broken:
        return []
    problems: list[str] = []
    for preset in chosen:
        try:
            compose_cells(preset, cells(preset, overrides))
        except yaml.YAMLError as exc:
            problems.append(f"--presets {preset}: {yaml_problem(exc)}")
    return problems


def _reproduce(args: argparse.Namespace, chosen: list[str], console: Console, tty: bool) -> int:
    """:func:`main` once its arguments are checked: plan every preset, run the jobs, then the analysis."""
    root: Path = args.results.resolve()
    from experiments.config_checks import writable_dir

    if why := writable_dir("--results", str(root)):  # NOTE: before a trace is converted into it
        print(f"python -m experiments.reproduce: {why}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    reports: list[GridReport] = []
    jobs: list[CellJob] = []
    plans: list[tuple[str, list[str]]] = []
    for preset in chosen:
        overrides = list(args.overrides)
        if preset.removeprefix("quick_") == "real_trace":
            trace = prepare_olmoe_trace(SHARED_TRACES, root / "traces" / "olmoe-decode.npz")
            if trace is None:
                reports.append(GridReport(preset, skipped=f"no OLMoE trace under {SHARED_TRACES}"))
                continue
            overrides.append(f"trace.path={trace}")
        if is_peer_preset(preset):
            overrides.append(prepare_peer_traces(preset, root, overrides, console.print))
        plans.append((preset, overrides))
    from experiments.warmup import warming

    try:
        with warming(args.workers if len(plans) else 1):  # NOTE: the kernels compile beside the planning
            planned = plan_grids(plans, root, args.recompute_stale, args.workers, args.extend_grid)
    except PermissionError as exc:  # NOTE: an unwritable results root: nothing was computed
        console.print(f"python -m experiments.reproduce: {exc}", style="red", markup=False)
        return 2
    except GridFileError as exc:  # NOTE: --extend-grid over a damaged grid.json: nothing was computed
        print(f"python -m experiments.reproduce: --extend-grid: {exc}", file=sys.stderr)
        return 2
    for report, todo in planned:
        reports.append(report)
        jobs.extend(todo)
    progress = progress_bars(console) if tty else None
    tracker = Tracker(Bars(progress) if progress is not None else Lines(console))
    for report in reports:
        if not report.skipped:
            tracker.add(report, sum(job.preset == report.preset for job in jobs))
    if progress is not None:
        with progress:
            run_jobs(jobs, args.workers, tracker.done, warmed=True)
    else:
        run_jobs(jobs, args.workers, tracker.done, warmed=True)
    summarise(console, reports, args.recompute_stale, code_version())
    if note := code_version_note():
        console.print(f"code version: {note}", style="yellow", markup=False, highlight=False)
    console.print(_seeds_line(chosen, args.overrides, args.extend_grid), highlight=False)
    console.print(
        f"grid time {time.perf_counter() - start:.0f} s ({tracker.line()}; "
        f"{args.workers} worker{'s' if args.workers > 1 else ''}); results in {root}",
        highlight=False,
        markup=False,
    )
    if not args.no_analysis:
        from analysis.__main__ import analyse

        out = analyse(root, root / "analysis", console, command=args.command)
        console.print(f"tables (Markdown, LaTeX): {out.out_dir}", markup=False)
        console.print(f"figures (PNG, PDF): {out.out_dir / 'figures'}", markup=False)
        for path in out.figures:
            if path.suffix == ".png":
                console.print(f"  {path}", markup=False)
        if out.refused:  # NOTE: each refusal was printed by the analysis, with why
            console.print(
                f"{len(out.refused)} preset(s) got no tables (refused above): exit status 1", style="red"
            )
            return 1
    return 1 if any(rep.failed for rep in reports) else 0


def _seeds_line(presets: list[str], overrides: list[str], extended: bool = False) -> str:
    """Which trace seeds each preset ran: one seed means its tables show no spread over seeds, unless
    ``extended`` (``--extend-grid``) kept earlier cells in the grid, which may add seeds."""
    by_count: dict[int, list[str]] = {}
    for preset in presets:
        seeds = {dict(o.split("=", 1) for o in cell).get("seed", "0") for cell in cells(preset, overrides)}
        by_count.setdefault(len(seeds), []).append(preset)
    if extended:
        parts = [f"{', '.join(names)}: {n}" for n, names in sorted(by_count.items())]
        return (
            "trace seeds run now: " + "; ".join(parts) + " (--extend-grid kept the grid's earlier cells: "
            "each table's note says the seeds it covers)"
        )
    parts = [
        f"{', '.join(names)}: {n} trace seed{'s' if n > 1 else ''}"
        + (" (the tables show no spread over seeds)" if n == 1 else " (the tables show mean and min-max)")
        for n, names in sorted(by_count.items())
    ]
    return "trace seeds: " + "; ".join(parts)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
