"""``make reproduce``'s grid runner: old and new code paths side by side, with identical rows checked.

Usage::

    python benchmarks/bench_reproduce.py [--preset quick_ep_scaling] [--workers 2] [overrides ...]
    python benchmarks/bench_reproduce.py --against REF [--preset overall,ablation,overhead] [--repeats 2]
        [overrides ...]
    python benchmarks/bench_reproduce.py --planning [--preset quick_overall,quick_overall_deepep,quick_nvl72]
        [--workers 2] [overrides ...]

Default mode: runs every cell of ``--preset`` into fresh temporary stores, side by side in one
invocation: in this process one cell after another (``--workers 1``, the runner's old code path) and
with ``--workers`` spawned worker processes, in the order old, new, new, old (so that a load that drifts
during the run weighs on both alike), and prints the mean wall time of each, the ratio, and the load
average before and after. The numba cache is warmed before either run, so neither pays for compilation.

``--against REF``: the same presets (comma-separated, run as ``--presets``) through the runner of git
revision ``REF`` (``git archive`` into a temporary folder) and through this working tree, each as its own
``python -m experiments.reproduce`` process with ``--workers`` workers, order old, new (, new, old with
``--repeats 2``); prints wall seconds and CPU seconds (user + sys of the runner and its workers), the
cells each computed, and the ratios. Each tree's numba cache is warmed first (not timed).

``--planning``: only the grid planning (composing and checking every cell of the comma-separated presets,
:func:`experiments.grid.runner.plan_grids`), in this process and with ``--workers`` spawned planners, order
one, many, many, one; prints wall seconds per run, the mean and the ratio, and checks that every run plans
the same jobs (cells and keys). Nothing is computed.

``--compose --against REF``: only composing, checking and keying every cell of the comma-separated
presets (``compose_cells``, ``build_spec``, ``cell_key``: what each cell pays before any work), in a
process of its own for ``REF``'s tree and for the working tree, order old, new, new, old; prints CPU
seconds per run, ms per cell and the ratio, and checks both trees key the same cells alike. Nothing is
computed.

Every run must store the same rows, cell for cell (checked on the deterministic result columns).
Extra arguments are Hydra overrides for every cell (e.g. ``model=qwen3-30b-a3b trace.preset=mixed``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from experiments.grid import cli, runner
from experiments.store.results_store import ResultsStore
from relibra.planners.warmup import compile_kernels

REPO = Path(__file__).resolve().parents[1]
METRICS = ["planner", "step_time_s", "skew_mean", "reorder_moved_experts", "t_comm_s", "t_compute_s"]
"""Deterministic result columns compared between runs (plan_time_s is wall time)."""


def _rows(root: Path, presets: list[str]) -> pd.DataFrame:
    frames = [ResultsStore(root / p).load().assign(preset=p) for p in presets]
    frame = pd.concat(frames, ignore_index=True).sort_values(["preset", "cell"]).reset_index(drop=True)
    return frame[["preset", "cell", *[m for m in METRICS if m in frame]]]


def _timed(preset: str, workers: int, overrides: list[str], root: Path) -> tuple[float, pd.DataFrame]:
    start = time.perf_counter()
    argv = ["--results", str(root), "--presets", preset, "--workers", str(workers), "--no-analysis"]
    if cli.main([*argv, *overrides]) != 0:
        raise SystemExit(f"{preset} with {workers} workers had failing cells")
    return time.perf_counter() - start, _rows(root, [preset])


def _one_vs_many(
    title: str,
    walls: dict[int, list[float]],
    workers: int,
    load_before: float,
    cells: int,
    names: tuple[str, str],
) -> None:
    """Print the wall seconds of the one-process runs (``walls[1]``) against the ``workers``-process ones."""
    one_s, many_s = (sum(walls[w]) / len(walls[w]) for w in (1, workers))
    table = Table(
        title=f"{title} (load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"{os.cpu_count()} cores)"
    )
    for column in ("runner", "processes", "wall s (each run)", "mean s", "s per cell", "speed-up"):
        table.add_column(column, justify="right")
    for name, n, seconds in ((names[0], 1, one_s), (names[1], workers, many_s)):
        runs = ", ".join(f"{w:.1f}" for w in walls[n])
        per_cell = seconds / max(1, cells)
        table.add_row(name, str(n), runs, f"{seconds:.1f}", f"{per_cell:.3f}", f"{one_s / seconds:.2f}")
    Console(width=140).print(table)


def _in_process_vs_workers(args: argparse.Namespace) -> None:
    compile_kernels()
    load_before = os.getloadavg()[0]
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    frames: list[pd.DataFrame] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, workers in enumerate((1, args.workers, args.workers, 1)):
            wall, frame = _timed(args.preset, workers, args.overrides, Path(tmp) / f"run{i}")
            walls[workers].append(wall)
            frames.append(frame)
    for frame in frames[1:]:
        pd.testing.assert_frame_equal(frames[0], frame, check_exact=True)
    title = f"{args.preset}: {len(frames[0])} cells, grid wall time"
    _one_vs_many(
        title, walls, args.workers, load_before, len(frames[0]), ("in process (old path)", "worker processes")
    )


def _planning(args: argparse.Namespace) -> None:
    presets = [p for p in args.preset.split(",") if p]
    load_before = os.getloadavg()[0]
    walls: dict[int, list[float]] = {1: [], args.workers: []}
    planned: list[list[tuple[str, str]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, workers in enumerate((1, args.workers, args.workers, 1)):
            plans = [(preset, list(args.overrides)) for preset in presets]
            start = time.perf_counter()
            out = runner.plan_grids(plans, Path(tmp) / f"run{i}", workers=workers)
            walls[workers].append(time.perf_counter() - start)
            planned.append([(job.preset, job.key) for _, jobs in out for job in jobs])
    if any(run != planned[0] for run in planned[1:]):
        raise SystemExit("the runs planned different jobs")
    title = f"planning {', '.join(presets)}: {len(planned[0])} cells"
    _one_vs_many(
        title, walls, args.workers, load_before, len(planned[0]), ("in process", "planner processes")
    )


def _export(ref: str, into: Path) -> Path:
    """The tree of git revision ``ref`` under ``into`` (``git archive``)."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def _child_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_tree(tree: Path, argv: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s, stdout) of ``python -m experiments.reproduce argv`` run in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cpu, start = _child_cpu_s(), time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "experiments.reproduce", *argv],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, _child_cpu_s() - cpu, done.stdout


def _against(args: argparse.Namespace) -> None:
    presets = [p for p in args.preset.split(",") if p]
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": _export(args.against, Path(tmp) / "old"), "new": REPO}
        for tree in trees.values():  # NOTE: compile each tree's kernels before timing anything
            warm = "from relibra.planners.warmup import compile_kernels as a; a()\n"
            warm += "from baselines.warmup import compile_kernels as b; b()"
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([sys.executable, "-c", warm], cwd=tree, env=env, check=True)
        load_before = os.getloadavg()[0]
        order = ["old", "new"] if args.repeats == 1 else ["old", "new", "new", "old"]
        runs: dict[str, list[tuple[float, float, str]]] = {"old": [], "new": []}
        frames = []
        for i, name in enumerate(order):
            root = Path(tmp) / f"run{i}"
            argv = ["--results", str(root), "--presets", ",".join(presets), "--workers", str(args.workers)]
            runs[name].append(_run_tree(trees[name], [*argv, "--no-analysis", *args.overrides]))
            frames.append(_rows(root, presets))
    for frame in frames[1:]:
        pd.testing.assert_frame_equal(frames[0], frame, check_exact=True)
    table = Table(
        title=f"{','.join(presets)} {' '.join(args.overrides)}: {len(frames[0])} cells, {args.workers} "
        f"workers, {args.against} against the working tree (load average {load_before:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after; {os.cpu_count()} cores); every run stored the same rows"
    )
    for column in ("code", "wall s (each run)", "CPU s (each run)", "wall ratio", "CPU ratio"):
        table.add_column(column, justify="right")
    mean = {n: [sum(float(r[i]) for r in runs[n]) / len(runs[n]) for i in (0, 1)] for n in runs}
    grids = []
    for name in ("old", "new"):
        label = f"{args.against} (old)" if name == "old" else "working tree (new)"
        grids += [f"{label}: {line}" for line in re.findall(r"^grid time .*$", runs[name][-1][2], re.M)]
        table.add_row(
            label,
            ", ".join(f"{r[0]:.1f}" for r in runs[name]),
            ", ".join(f"{r[1]:.1f}" for r in runs[name]),
            f"{mean['old'][0] / mean[name][0]:.2f}",
            f"{mean['old'][1] / mean[name][1]:.2f}",
        )
    console = Console(width=160)
    console.print(table)
    for line in grids:
        console.print(line, highlight=False, soft_wrap=True)
    if args.log is not None:  # NOTE: every run's per-cell lines (preset, cell, seconds), for the record
        args.log.write_text(
            "".join(f"== {order[i]} run {i}\n{r[2]}" for i, r in enumerate(_in_order(runs, order)))
        )


_COMPOSE = """
import json, sys, time
from experiments.config.presets import cells, compose_cells
from experiments.config.spec import build_spec
from experiments.store.keys import cell_key
keys, start = [], time.process_time()
for preset in sys.argv[1].split(","):
    grid = [[*c, f"results_dir=/nonexistent/{preset}"] for c in cells(preset)]
    keys += [cell_key(build_spec(composed).composed) for composed in compose_cells(preset, grid)]
print(json.dumps({"cpu_s": time.process_time() - start, "keys": keys}))
"""
"""Composes, checks and keys every cell of the presets given in argv[1] (CPU seconds after the imports)."""


def _compose(args: argparse.Namespace) -> None:
    if args.against is None:
        raise SystemExit("--compose compares two trees: give --against REF")
    presets = ",".join(p for p in args.preset.split(",") if p)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": _export(args.against, Path(tmp) / "old"), "new": REPO}
        runs: dict[str, list[dict]] = {"old": [], "new": []}
        for name in ("old", "new", "new", "old"):
            env = {**os.environ, "PYTHONPATH": str(trees[name])}
            done = subprocess.run(
                [sys.executable, "-c", _COMPOSE, presets], cwd=trees[name], env=env, check=True,
                capture_output=True, text=True,
            )  # fmt: skip
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    if sorted(runs["old"][0]["keys"]) != sorted(runs["new"][0]["keys"]):  # NOTE: the sweep order may differ
        raise SystemExit("the two trees key the cells differently")
    cells_n = len(runs["new"][0]["keys"])
    title = f"composing, checking and keying {presets}: {cells_n} cells, {args.against} against the working "
    table = Table(title=title + "tree (CPU s of one process, imports excluded); both key the cells alike")
    for column in ("code", "CPU s (each run)", "ms per cell", "CPU ratio"):
        table.add_column(column, justify="right")
    mean = {n: sum(r["cpu_s"] for r in runs[n]) / len(runs[n]) for n in runs}
    for name in ("old", "new"):
        table.add_row(
            f"{args.against} (old)" if name == "old" else "working tree (new)",
            ", ".join(f"{r['cpu_s']:.1f}" for r in runs[name]),
            f"{1000 * mean[name] / cells_n:.1f}",
            f"{mean[name] / mean['old']:.2f}",
        )
    Console(width=160).print(table)


def _in_order(
    runs: dict[str, list[tuple[float, float, str]]], order: list[str]
) -> list[tuple[float, float, str]]:
    seen = {name: 0 for name in runs}
    out = []
    for name in order:
        out.append(runs[name][seen[name]])
        seen[name] += 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", default="quick_ep_scaling", help="preset(s); comma-separated with --against"
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--against", default=None, help="git revision whose runner is the old code path")
    parser.add_argument(
        "--repeats", type=int, choices=(1, 2), default=2, help="with --against: 1 old,new; 2 also new,old"
    )
    parser.add_argument(
        "--log", type=Path, default=None, help="with --against: write every run's output here"
    )
    parser.add_argument("--planning", action="store_true", help="time only the grid planning (plan_grids)")
    parser.add_argument(
        "--compose", action="store_true", help="with --against: time composing, checking and keying cells"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.compose:
        _compose(args)
        return
    if args.planning:
        _planning(args)
    elif args.against is None:
        _in_process_vs_workers(args)
    else:
        _against(args)


if __name__ == "__main__":
    main()
