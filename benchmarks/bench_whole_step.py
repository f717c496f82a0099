"""The simulator's own speed on the MoE-only step and on the whole step, side by side in one run.

Usage: ``python benchmarks/bench_whole_step.py [--repeats 5] [--before DIR]``. One Qwen3-30B-A3B cell (2
nodes x 8 GPUs, 256 rollouts of up to 4096 tokens, one RL step, Megatron-LM's planner so that planning
takes no time) is simulated under ``simulator.step=moe``, ``whole`` and ``whole`` with every RL pass and
full recompute, the modes interleaved ``--repeats`` times; the table gives the median wall seconds of
``simulate`` (inputs built once). ``--before DIR`` also times the same cell with the code of the checkout
``DIR`` (its default step), in a subprocess per repeat, interleaved with the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CELL = [
    "model=qwen3-30b-a3b",
    "cluster.nodes=2",
    "trace.preset=mixed",
    "trace.num_batches=1",
    "trace.samples_per_batch=256",
    "trace.max_tokens=4096",
    "planner=megatron",
    "control_plane.enabled=false",
]
MODES = {
    "moe": ["simulator.step=moe"],
    "whole": ["simulator.step=whole"],
    "whole + passes + full recompute": [
        "simulator.step=whole",
        "workload.rl_passes=[reference,recompute,update]",
        "training.recompute=full",
    ],
}


def time_cell(conf_dir: str, overrides: list[str]) -> tuple[float, float]:
    """(wall seconds of ``simulate``, simulated step seconds) of the cell under ``overrides``."""
    from hydra import compose, initialize_config_dir

    from experiments.config.build import (
        build_cluster,
        build_cost,
        build_model,
        build_planner,
        build_workload_for,
        load_counts,
        sim_options,
    )
    from experiments.config.spec import build_spec
    from relibra.simulator import simulate

    with initialize_config_dir(conf_dir, version_base="1.3", job_name="bench"):
        cfg = build_spec(compose("config", overrides=overrides))
    cluster, model = build_cluster(cfg), build_model(cfg)
    cost = build_cost(cfg, cluster, model)
    counts, workload = build_workload_for(cfg, load_counts(cfg), cluster.num_gpus)
    planner = build_planner(cfg)
    t0 = time.perf_counter()
    res = simulate(planner, counts, workload, cluster, model, cost, sim_options(cfg, False))
    return time.perf_counter() - t0, res.metrics["step_time_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", help="a checkout to time beside this one (its default step)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one timing under another checkout's code (sys.path set by the parent)
        print(json.dumps(time_cell(str(Path(args.child) / "experiments" / "conf"), CELL)))
        return
    here = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(here))
    conf = str(here / "experiments" / "conf")
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, float] = {}
    if args.before:
        walls["before (" + args.before + ")"] = []
    for _ in range(args.repeats):
        for mode, extra in MODES.items():
            wall, step = time_cell(conf, [*CELL, *extra])
            walls[mode].append(wall)
            steps[mode] = step
        if args.before:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--child", args.before],
                env={"PYTHONPATH": args.before, "PATH": "/usr/bin:/bin"},
                capture_output=True,
                text=True,
                check=True,
                cwd=args.before,
            )
            wall, step = json.loads(out.stdout.strip().splitlines()[-1])
            key = "before (" + args.before + ")"
            walls[key].append(wall)
            steps[key] = step
    print(f"{'mode':45s} {'simulate s (median)':>20s} {'min':>8s} {'step s':>10s}")
    for mode, ws in walls.items():
        print(f"{mode:45s} {statistics.median(ws):20.3f} {min(ws):8.3f} {steps[mode]:10.4f}")


if __name__ == "__main__":
    main()
