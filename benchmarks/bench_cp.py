"""Context parallelism at long sequences: what splitting samples over TP x CP groups costs the harness.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_cp.py [--tokens 131072] [--samples 16] [--nodes 1]
        [--cps 1,8] [--planners megatron,relibra]

Qwen3-30B-A3B, one batch of ``--samples`` rollouts of exactly ``--tokens`` tokens each (the synthetic
reasoning preset's per-sample routing, redrawn for that length: :func:`long_counts`), EP ``8 * --nodes``, one
sample per TP x CP group per micro-batch, the whole step, no memory check (a 128K-token sample does not fit
one GPU at CP 1; the point is the harness's time). Per CP size and planner: micro-batches, the busiest GPU's
tokens per micro-batch, the seconds to build the workload (the samples split into their ranks and laid out,
:mod:`relibra.workload`), the simulation's wall seconds, the planner's own ``plan_time_s`` and the simulated
step and its attention seconds (the exposed ``p2p`` ring included, :mod:`relibra.cost.context`). Each planner
is simulated bare (no control plane).
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
from _common import CONF
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
from relibra.types import SampleCounts


def long_counts(given: SampleCounts, tokens: int, seed: int = 0) -> SampleCounts:
    """``given``'s samples at exactly ``tokens`` tokens: each (sample, layer)'s ``tokens * top_k`` slots drawn
    from the expert shares of its counts (the preset's skew at the benchmark's length)."""
    c = given.counts.astype(np.float64)
    probs = (c / c.sum(axis=-1, keepdims=True)).reshape(-1, c.shape[-1])
    rng = np.random.default_rng(seed)
    drawn = rng.multinomial(tokens * given.top_k, probs).reshape(c.shape).astype(np.int32)
    return replace(given, counts=drawn, tokens=np.full(given.num_samples, tokens, dtype=np.int64))


def run(tokens: int, samples: int, nodes: int, cps: list[int], planners: list[str]) -> None:
    print(
        f"\n### CP at {tokens:,}-token rollouts (Qwen3-30B-A3B, EP {8 * nodes}, {samples} samples, MBS 1)\n"
    )
    print(
        "| cp | planner | micro-batches | tokens/GPU/mb | build s | simulate s | plan_time_s | step s "
        "| attention s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for cp in cps:
        for planner in planners:
            overrides = [
                "model=qwen3-30b-a3b",
                f"cluster.nodes={nodes}",
                "trace.preset=reasoning",
                "trace.num_batches=1",
                f"trace.samples_per_batch={samples}",
                "trace.max_tokens=8192",  # NOTE: the preset's routing; the lengths are long_counts'
                f"parallel.cp={cp}",
                "workload.samples_per_microbatch=1",
                "simulator.memory_check=off",
                "control_plane.enabled=false",
                f"planner={planner}",
                "logger=none",
            ]
            with initialize_config_dir(str(CONF), version_base="1.3", job_name="bench_cp"):
                cfg = build_spec(compose("config", overrides=overrides))
            cluster, model = build_cluster(cfg), build_model(cfg)
            cost = build_cost(cfg, cluster, model)
            given = long_counts(load_counts(cfg), tokens)
            t0 = time.perf_counter()
            counts, workload = build_workload_for(cfg, given, cluster.num_gpus)
            build_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            res = simulate(
                build_planner(cfg), counts, workload, cluster, model, cost, sim_options(cfg, False)
            )
            sim_s = time.perf_counter() - t0
            m = res.metrics
            print(
                f"| {cp} | {planner} | {workload.num_microbatches} | {int(workload.tokens.max()):,} | "
                f"{build_s:.2f} | {sim_s:.2f} | {m.get('plan_time_s', 0.0):.2f} | {m['step_time_s']:.3f} | "
                f"{m['t_attention_s']:.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--cps", default="1,8")
    parser.add_argument("--planners", default="megatron,relibra")
    args = parser.parse_args()
    run(
        args.tokens,
        args.samples,
        args.nodes,
        [int(c) for c in args.cps.split(",")],
        args.planners.split(","),
    )


if __name__ == "__main__":
    main()
