"""The sample layout stage: how balanced each layout's micro-batches are, and what that does to every planner.

Usage (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_layout.py [--samples 512] [--batches 4] [--nodes 4]
        [--planners megatron,eplb,...] [--no-steps]

1. Per synthetic preset (reasoning, instruction following, coding, mixed), per layout (``balanced``,
   ``contiguous``): micro-batches per batch and, over all micro-batches, the median and p90 of the per-GPU
   token max/mean and of the per-GPU causal-attention-pair max/mean (the default workload: 2 rollouts per GPU
   per micro-batch), at the EP size of ``--nodes`` 8-GPU nodes.
2. Qwen3-30B-A3B, reasoning, ``--batches`` steps of ``--samples`` rollouts up to 8192 tokens, EP
   ``8 * --nodes`` (paper scale: 4 x 512 at EP 32): the simulated step time of every planner under each
   layout, with ReLibra's lead over EPLB+, the fraction of Balanced and of force-balanced, and the experts
   each planner moves per step with their migration bytes. Each planner is simulated bare (no control plane:
   the plans are the same, docs/control_plane.md). Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import CONF, timed_simulation
from hydra import compose, initialize_config_dir

from experiments.config.build import load_counts
from experiments.config.spec import build_spec
from relibra.layout import LAYOUTS, layout_samples, microbatch_balance
from relibra.simulator import SimResult
from relibra.trace.synthetic import PRESETS, generate_counts
from relibra.workload import gpu_token_stats

PLANNERS = (
    "megatron",
    "popfetcher",
    "eplb",
    "lplb",
    "relibra",
    "relibra_no_locality",
    "relibra_balance",
    "relibra_portfolio",
    "force_balanced",
    "balanced",
)


def layout_balance(samples: int, batches: int, nodes: int) -> None:
    """Part 1: the per-micro-batch balance of each layout on every preset."""
    g = 8 * nodes
    print(
        f"\n### Layout balance (EP {g}, {batches} x {samples} rollouts up to 8192 tokens, 2 per GPU per mb)\n"
    )
    print("| preset | layout | micro-batches / step | tokens max/mean p50 | p90 | attention p50 | p90 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for preset in PRESETS:
        # NOTE: a layout depends on the tokens only; one layer of 128 experts keeps the generator cheap.
        counts = generate_counts(preset, 128, 1, 8, batches, samples, seed=0, max_tokens=8192)
        for layout in LAYOUTS:
            placed = layout_samples(counts.tokens, counts.batch_offsets, g, 2, None, layout)
            tokens, pairs = gpu_token_stats(
                counts.tokens, placed.sample_gpu, placed.sample_mb, placed.num_microbatches, g
            )
            t_ratio, p_ratio = microbatch_balance(tokens), microbatch_balance(pairs)
            print(
                f"| {preset} | {layout} | {placed.num_microbatches / batches:.1f} | "
                f"{np.median(t_ratio):.3f} | {np.percentile(t_ratio, 90):.3f} | "
                f"{np.median(p_ratio):.3f} | {np.percentile(p_ratio, 90):.3f} |"
            )


def _ratio(step: dict[str, float], over: str, under: str) -> float:
    """``step[over] / step[under]`` (NaN when either planner was not run)."""
    return step[over] / step[under] if {over, under} <= step.keys() else float("nan")


def step_times(samples: int, batches: int, nodes: int, planners: list[str]) -> None:
    """Part 2: every planner's step time under each layout (the table of the fair-harness change)."""
    base = [
        "model=qwen3-30b-a3b",
        f"cluster.nodes={nodes}",
        "trace.preset=reasoning",
        f"trace.num_batches={batches}",
        f"trace.samples_per_batch={samples}",
        "trace.max_tokens=8192",
    ]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        t0 = time.perf_counter()
        counts = load_counts(build_spec(compose(config_name="config", overrides=base)))
        print(f"\n(generated {counts.num_samples} rollouts in {time.perf_counter() - t0:.0f} s)")
        results: dict[tuple[str, str], SimResult] = {}
        walls: dict[tuple[str, str], float] = {}
        for layout in LAYOUTS:
            for planner in planners:
                cfg = compose(
                    config_name="config", overrides=[*base, f"planner={planner}", f"workload.layout={layout}"]
                )
                results[layout, planner], walls[layout, planner] = timed_simulation(cfg, counts)
    g = 8 * nodes
    print(f"\n### Step time (s), Qwen3-30B-A3B, EP {g}, reasoning, {batches} x {samples} rollouts\n")
    print("| layout | " + " | ".join(planners) + " |")
    print("|---|" + "---:|" * len(planners))
    for layout in LAYOUTS:
        cells = [f"{results[layout, p].metrics['step_time_s']:.2f}" for p in planners]
        print(f"| {layout} | " + " | ".join(cells) + " |")
    print("\n| layout | ReLibra / EPLB+ speedup | ReLibra % of Balanced | ReLibra % of force-balanced |")
    print("|---|---:|---:|---:|")
    for layout in LAYOUTS:
        step = {p: results[layout, p].metrics["step_time_s"] for p in planners}

        lead, bal, force = (
            _ratio(step, over, "relibra") * scale
            for over, scale in (("eplb", 1.0), ("balanced", 100.0), ("force_balanced", 100.0))
        )
        print(f"| {layout} | {lead:.2f} | {bal:.1f} | {force:.1f} |")
    print(
        "\n| layout | planner | moved experts / step | migration GB / step | attention s | comm s | sim s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for layout in LAYOUTS:
        for p in planners:
            m = results[layout, p].metrics
            print(
                f"| {layout} | {p} | {m['reorder_moved_experts']:.0f} | {m['migration_bytes'] / 1e9:.2f} | "
                f"{m['t_attention_s']:.2f} | {m['t_comm_s']:.2f} | {walls[layout, p]:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512, help="rollouts per step (paper: 512)")
    parser.add_argument("--batches", type=int, default=4, help="steps (paper: 4)")
    parser.add_argument("--nodes", type=int, default=4, help="8-GPU nodes of the EP group (paper, 30B: 4)")
    parser.add_argument("--planners", default=",".join(PLANNERS), help="planner configs, comma-separated")
    parser.add_argument("--no-steps", action="store_true", help="only the layout balance (part 1)")
    args = parser.parse_args()
    layout_balance(args.samples, args.batches, args.nodes)
    if not args.no_steps:
        step_times(args.samples, args.batches, args.nodes, args.planners.split(","))


if __name__ == "__main__":
    main()
