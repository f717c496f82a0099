"""``make reproduce`` (``python -m experiments.reproduce``): the paper's grids, quick scale, then the tables.

Runs every cell of the presets of ``--scale`` (default ``quick``: the paper's six grids at the quick scale;
each cell is composed from its preset and handed to ``experiments.run.run``), in worker processes, one per
core (``--workers``), showing cells done, cells left, cells reused and elapsed time. A cell that several
presets share (same cell key) is computed once and its rows copied into the other presets' stores; cells of
one trace go to the workers one after another, so each worker's cache (:mod:`experiments.inputs`) builds
its counts and workload once.
Finished cells are kept in ``RESULTS/<preset>/`` by the results store, so a rerun only redoes what is
missing; finished cells that other code computed (their ``code_version``, see :mod:`relibra.provenance`)
are reported, and recomputed with ``--recompute-stale``. Then ``analysis`` prints the tables beside the
paper's numbers and writes them with the figures under ``RESULTS/analysis``.

``real_trace`` needs the OLMoE decode trace (``../shared/traces/olmoe-decode`` or ``RELIBRA_SHARED_TRACES``);
it is converted once to ``RESULTS/traces/olmoe-decode.npz`` and the preset is skipped when it is absent.

Examples::

    python -m experiments.reproduce                          # the paper's six grids, quick scale (main job)
    python -m experiments.reproduce --scale quick-field      # the grids beyond the paper, quick scale
    python -m experiments.reproduce --presets quick_ablation,quick_datasets
    python -m experiments.reproduce --scale paper            # the paper's six grids at its scale
    python -m experiments.reproduce --scale field            # the grids beyond the paper, at its scale
    python -m experiments.reproduce logger=wandb             # extra overrides go to every cell
    python -m experiments.reproduce planner=megatron,relibra # ... and may replace a preset's sweep
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from experiments.config.presets import cells, compose_cells
from experiments.grid.jobs import CellJob, GridReport
from experiments.grid.peer_traces import is_peer_preset, prepare_peer_traces
from experiments.grid.progress import Bars, Lines, Tracker, progress_bars, summarise
from experiments.grid.runner import (
    SCALES,
    SHARED_TRACES,
    plan_grids,
    prepare_olmoe_trace,
    run_jobs,
)
from experiments.store.cell_files import GridFileError
from relibra.provenance import code_version, code_version_note

__all__ = ["main"]


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
        choices=tuple(SCALES),
        default="quick",
        help="quick: the paper's six grids at the quick scale (default); quick-field: the grids beyond the "
        "paper at the quick scale; paper: the paper's six grids at its scale; "
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
    presets = args.presets if args.presets is not None else ",".join(SCALES[args.scale])
    from experiments.config.errors import ConfigError
    from experiments.config.presets import presets as known_presets
    from experiments.config.schema import override_problems

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
    tables by it), and the overrides :func:`experiments.config.schema.override_problems` refuses."""
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
    """The malformed config files (:attr:`experiments.config.schema.ConfigSchema.broken`) that a chosen
    preset's cells use, one problem each naming the preset and the file; a malformed file no chosen preset
    uses is left alone. Composes the cells only when the config schema found such a file."""
    import yaml

    from experiments.config.schema import config_schema, yaml_problem

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
    from experiments.config.checks import writable_dir

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
    from experiments.grid.warmup import warming

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
