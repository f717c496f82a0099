"""``make reproduce``'s grid runner: one preset in one process (the old path) and in worker processes.

Usage: ``python benchmarks/bench_reproduce.py [--preset quick_ep_scaling] [--workers 2] [overrides ...]``.

Runs every cell of ``--preset`` twice into fresh temporary stores, side by side in one invocation: first
in this process one cell after another (``--workers 1``, the runner's old code path), then with
``--workers`` spawned worker processes, and prints both wall times and their ratio. The numba cache is
warmed before either run, so neither pays for compilation. Both runs store the same rows (checked).
Extra arguments are Hydra overrides for every cell (e.g. ``trace.num_batches=1`` for a faster check).
"""

from __future__ import annotations

import argparse
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
    with tempfile.TemporaryDirectory() as tmp:
        one_s, one = _timed(args.preset, 1, args.overrides, Path(tmp) / "one")
        many_s, many = _timed(args.preset, args.workers, args.overrides, Path(tmp) / "many")
    metrics = ["cell", "planner", "step_time_s", "skew_mean", "reorder_moved_experts"]
    pd.testing.assert_frame_equal(one[metrics], many[metrics], check_exact=True)
    table = Table(title=f"{args.preset}: {len(one)} cells, grid wall time")
    for column in ("runner", "workers", "wall s", "speed-up"):
        table.add_column(column, justify="right")
    table.add_row("in process (old path)", "1", f"{one_s:.1f}", "1.00")
    table.add_row("worker processes", str(args.workers), f"{many_s:.1f}", f"{one_s / many_s:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
