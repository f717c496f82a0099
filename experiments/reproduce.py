"""``make reproduce`` (``python -m experiments.reproduce``): the quick presets, then the paper's tables.

Runs every cell of the ``quick_*`` presets in this process, one after another (Hydra's local, in-process
flow: each cell is composed from its preset and handed to ``experiments.run.run``), showing cells done,
cells left, cells reused and elapsed time. Finished cells are kept in ``RESULTS/<preset>/`` by the
results store, so a rerun only redoes what is missing; finished cells that other code computed (their
``code_version``, see :mod:`relibra.provenance`) are reported, and recomputed with ``--recompute-stale``.
Then ``analysis`` prints the tables beside the
paper's numbers and writes them with the figures under ``RESULTS/analysis``.

``real_trace`` needs the OLMoE decode trace (``../shared/traces/olmoe-decode`` or ``RELIBRA_SHARED_TRACES``);
it is converted once to ``RESULTS/traces/olmoe-decode.npz`` and the preset is skipped when it is absent.

Examples::

    python -m experiments.reproduce                          # the quick presets (about 10 minutes)
    python -m experiments.reproduce --presets quick_ablation,quick_datasets
    python -m experiments.reproduce --scale paper            # the same grids at the paper's scale
    python -m experiments.reproduce logger=wandb             # extra overrides go to every cell
    python -m experiments.reproduce planner=megatron,relibra # ... and may replace a preset's sweep
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from omegaconf import DictConfig
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from experiments.grid import cells, compose_cells
from experiments.store import CorruptCellError, ResultsStore, cell_key, stored_code_version
from relibra.provenance import code_version

__all__ = ["PAPER_PRESETS", "QUICK_PRESETS", "GridReport", "main", "prepare_olmoe_trace", "run_grid"]

QUICK_PRESETS = (
    "quick_overall",
    "quick_ablation",
    "quick_ep_scaling",
    "quick_datasets",
    "quick_overhead",
    "quick_real_trace",
)
PAPER_PRESETS = tuple(p.removeprefix("quick_") for p in QUICK_PRESETS)
"""The same six grids at the paper's scale (4 RL steps of 512 rollouts; ``make reproduce-paper``)."""
REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("RELIBRA_SHARED_TRACES", REPO.parent / "shared" / "traces"))
OLMOE_SAMPLES_PER_BATCH = 100
"""The 200 OLMoE prompts become 2 batches (RL steps) of 100 rollouts each."""


@dataclass
class GridReport:
    """What happened to one preset's cells."""

    preset: str
    ran: int = 0
    reused: int = 0
    stale: dict[str, int] = field(default_factory=dict)
    """Reused cells computed by other code than the current one: their ``code_version`` -> count."""
    failed: list[tuple[list[str], str]] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    """Cell files found unreadable; each was computed again (or is listed in ``failed``)."""
    skipped: str = ""


def prepare_olmoe_trace(shared: Path, out: Path) -> Path | None:
    """The OLMoE decode trace as a trace file at ``out`` (made once); None when ``shared`` lacks it."""
    if out.is_file():
        return out
    source = shared / "olmoe-decode"
    if not source.is_dir():
        return None
    from relibra.importers import load_olmoe_decode
    from relibra.trace import save_trace

    out.parent.mkdir(parents=True, exist_ok=True)
    return save_trace(load_olmoe_decode(source, samples_per_batch=OLMOE_SAMPLES_PER_BATCH), out)


def run_grid(
    preset: str,
    results_root: Path,
    overrides: list[str],
    progress: Progress | None = None,
    recompute_stale: bool = False,
) -> GridReport:
    """Run every unfinished cell of ``preset`` into ``results_root/<preset>`` (the store skips finished ones).

    A finished cell computed by other code than the current one (its ``code_version``) is counted in
    ``stale`` and reused, or with ``recompute_stale`` computed again (its stored rows are replaced only when
    the new ones are written). An unreadable cell file counts as missing (listed in ``corrupt``) and is
    computed again. A failing cell is recorded and the grid goes on; nothing else is retried.
    """
    from experiments.run import run  # NOTE: imported late so that `--help` does not import every planner

    report = GridReport(preset)
    store_dir = results_root / preset
    store = ResultsStore(store_dir)
    store.check_writable()  # before any cell is computed: PermissionError naming the folder
    grid = cells(preset, overrides)  # NOTE: overrides may sweep too (e.g. planner=megatron,relibra)
    configs = compose_cells(preset, [[*cell, f"results_dir={store_dir}"] for cell in grid])
    store.write_grid(cell_key(cfg) for cfg in configs)
    task = progress.add_task(preset, total=len(grid), reused=0, cell="") if progress is not None else None
    for cell, cfg in zip(grid, configs):
        key = cell_key(cfg)
        if progress is not None and task is not None:
            dataset = cfg.trace.get("dataset") or cfg.trace.preset
            progress.update(task, cell=f"{cfg.model.name} {dataset} EP{_ep(cfg)} {cfg.planner.name}")
        try:  # NOTE: one bad cell (a config, a computation, an unreadable stored file) must not cost the rest
            try:
                rows: pd.DataFrame | None = store.read(key)
            except FileNotFoundError:
                rows = None
            except CorruptCellError as err:
                report.corrupt.append(str(err.path))
                rows = None  # counts as missing: computed again below, and the new file replaces it
            stored = stored_code_version(rows) if rows is not None else None
            if stored is not None and stored != code_version():
                report.stale[stored] = report.stale.get(stored, 0) + 1
            if stored is not None and not (recompute_stale and stored != code_version()):
                report.reused += 1
            else:
                # a stale cell (stored is not None) is computed again and replaces its old rows
                run(cfg, run_dir=store_dir / "runs" / key, recompute=stored is not None)
                report.ran += 1
        except Exception as exc:
            report.failed.append((cell, f"{type(exc).__name__}: {exc}"))
            if os.environ.get("RELIBRA_DEBUG"):
                traceback.print_exc()
        if progress is not None and task is not None:
            progress.update(task, advance=1, reused=report.reused)
    if progress is not None and task is not None:
        progress.update(task, cell="")
    return report


def _ep(cfg: DictConfig) -> int:
    return int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("cells, {task.fields[reused]} reused"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        TextColumn("[dim]{task.fields[cell]}"),
        console=console,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.reproduce", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides for every cell (e.g. logger=wandb)"
    )
    parser.add_argument(
        "--results", type=Path, default=Path("results"), help="results root (default results/)"
    )
    parser.add_argument(
        "--presets",
        default=None,
        help="comma-separated presets to run, in order (default: the six presets of --scale)",
    )
    parser.add_argument(
        "--scale",
        choices=("quick", "paper"),
        default="quick",
        help="quick: the quick_* presets (default, about 10 minutes); paper: the paper-scale presets",
    )
    parser.add_argument("--no-analysis", action="store_true", help="only run the cells")
    parser.add_argument(
        "--recompute-stale",
        action="store_true",
        help="recompute finished cells whose results came from other code (their code_version)",
    )
    args = parser.parse_args(argv)
    # NOTE: tables are wide; when output is not a terminal (CI logs, files) rich would assume 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    root: Path = args.results.resolve()
    start = time.perf_counter()
    reports: list[GridReport] = []
    with _progress(console) as progress:
        presets = args.presets or ",".join(QUICK_PRESETS if args.scale == "quick" else PAPER_PRESETS)
        for preset in [p for p in presets.split(",") if p]:
            overrides = list(args.overrides)
            if preset.removeprefix("quick_") == "real_trace":
                trace = prepare_olmoe_trace(SHARED_TRACES, root / "traces" / "olmoe-decode.npz")
                if trace is None:
                    reports.append(GridReport(preset, skipped=f"no OLMoE trace under {SHARED_TRACES}"))
                    continue
                overrides.append(f"trace.path={trace}")
            try:
                reports.append(run_grid(preset, root, overrides, progress, args.recompute_stale))
            except PermissionError as exc:  # NOTE: an unwritable results root: nothing was computed
                console.print(f"[red]python -m experiments.reproduce: {exc}")
                return 2
    for rep in reports:
        if rep.skipped:
            console.print(f"[yellow]{rep.preset}: skipped ({rep.skipped})")
            continue
        console.print(f"{rep.preset}: {rep.ran} cells run, {rep.reused} reused, {len(rep.failed)} failed")
        if rep.stale:
            versions = ", ".join(f"{n} by {v}" for v, n in sorted(rep.stale.items()))
            what = "recomputed" if args.recompute_stale else "reused; --recompute-stale recomputes them"
            console.print(
                f"  [yellow]{sum(rep.stale.values())} finished cells came from other code than "
                f"{code_version()} ({versions}): {what}"
            )
        for unreadable in rep.corrupt:
            console.print(
                f"  [yellow]unreadable cell file[/yellow] {unreadable}: treated as missing and computed again"
            )
        for cell, why in rep.failed:
            console.print(f"  [red]failed[/red] {' '.join(cell)}: {why.splitlines()[0]}")
    console.print(f"grid time {time.perf_counter() - start:.0f} s; results in {root}")
    if not args.no_analysis:
        from analysis.__main__ import analyse

        out = analyse(root, root / "analysis", console)
        console.print(f"tables (Markdown, LaTeX): {out.out_dir}")
        console.print(f"figures (PNG, PDF): {out.out_dir / 'figures'}")
        for path in out.figures:
            if path.suffix == ".png":
                console.print(f"  {path}")
    return 1 if any(rep.failed for rep in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
