"""``make reproduce``'s grid runner: one preset in one process (the old path) and in worker processes.

Usage: ``python benchmarks/bench_reproduce.py [--preset quick_ep_scaling] [--workers 2] [overrides ...]``.

Runs every cell of ``--preset`` into fresh temporary stores, side by side in one invocation: in this
process one cell after another (``--workers 1``, the runner's old code path) and with ``--workers``
spawned worker processes, in the order old, new, new, old (so that a load that drifts during the run
weighs on both alike), and prints the mean wall time of each, the ratio, and the load average before and
after. The numba cache is warmed before either run, so neither pays for compilation. Every run stores
the same rows (checked).
Extra arguments are Hydra overrides for every cell (e.g. ``trace.num_batches=1`` for a faster check).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from experiments import reproduce
from experiments.store import ResultsStore
from relibra.planners.warmup import compile_kernels


def _timed(preset: str, workers: int, overrides: list[str], root: Path) -> tuple[float, pd.DataFrame]:
    start = time.perf_counter()
    argv = ["--results", str(root), "--presets", preset, "--workers", str(workers), "--no-analysis"]
    if reproduce.main([*argv, *overrides]) != 0:
        raise SystemExit(f"{preset} with {workers} workers had failing cells")
    frame = ResultsStore(root / preset).load().sort_values("cell").reset_index(drop=True)
    return time.perf_counter() - start, frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick_ep_scaling")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    compile_kernels()
    load_before = os.getloadavg()[0]
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    frames: list[pd.DataFrame] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, workers in enumerate((1, args.workers, args.workers, 1)):
            wall, frame = _timed(args.preset, workers, args.overrides, Path(tmp) / f"run{i}")
            walls[workers].append(wall)
            frames.append(frame)
    metrics = ["cell", "planner", "step_time_s", "skew_mean", "reorder_moved_experts"]
    for frame in frames[1:]:
        pd.testing.assert_frame_equal(frames[0][metrics], frame[metrics], check_exact=True)
    one_s, many_s = (sum(walls[w]) / len(walls[w]) for w in (1, args.workers))
    table = Table(
        title=f"{args.preset}: {len(frames[0])} cells, grid wall time (load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after; {os.cpu_count()} cores)"
    )
    for column in ("runner", "workers", "wall s (each run)", "mean s", "speed-up"):
        table.add_column(column, justify="right")
    for name, workers, seconds in (
        ("in process (old path)", 1, one_s),
        ("worker processes", args.workers, many_s),
    ):
        runs = ", ".join(f"{w:.1f}" for w in walls[workers])
        table.add_row(name, str(workers), runs, f"{seconds:.1f}", f"{one_s / seconds:.2f}")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
