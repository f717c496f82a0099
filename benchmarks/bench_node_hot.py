"""A whole node hot: planners on a workload whose hot expert set is exactly node 0's experts.

Usage: ``python benchmarks/bench_node_hot.py [--planners a,b,...] [--steps S] [--tokens T] [--hot-share P]
[--quick-cells] [--grid-cells] [--no-node-hot] [--set LABEL=planner=NAME,KEY=V,...]``.

The workload (a stand-in for the Megatron-LM token-imbalance benchmark's W2 "hot expert set" at EP 32,
whose hot set is node 0's experts): Qwen3-30B-A3B at EP 32 (4 nodes x 8 GPUs), ``S`` steps (batches) of one
``T``-token sample per GPU; every layer routes each token's ``k`` slots by a multinomial in which the
``E / N`` experts of node 0 (Megatron-LM's static placement) take ``P`` of the slots and the others share the
rest evenly, drawn per (sample, layer) from seed 0. Each planner runs through the Hydra config as
``python -m experiments.run`` would (``experiments.run.compute``'s builders), and the table prints its
step time over force-balanced's on the same samples. ``--quick-cells`` also runs the paper's quick cells
(``+experiment=quick_overall``, Qwen3-30B-A3B mixed and reasoning, EP 32; one RL step each),
``--grid-cells`` a 4-step cell of the synthetic mixed preset (256 rollouts of up to 2,048 tokens per step),
so a change is seen on all of them in one run.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import CONF, timed_simulation
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from relibra.types import SampleCounts

console = Console(width=160)

BASE = ["model=qwen3-30b-a3b", "cluster.nodes=4", "cluster.gpus_per_node=8", "logger=none"]


def hot_counts(
    num_experts: int,
    num_layers: int,
    top_k: int,
    num_gpus: int,
    hot_experts: int,
    steps: int,
    tokens: int,
    hot_share: float,
    seed: int = 0,
) -> SampleCounts:
    """Per-sample counts [S, L, E] (S = steps * num_gpus, one ``tokens``-token sample per GPU and step): the
    first ``hot_experts`` experts (node 0's at ``E * gpus_per_node / G``, GPU 0's at ``E / G``) take
    ``hot_share`` of every sample's routed slots, the others share the rest evenly."""
    p = np.full(num_experts, (1.0 - hot_share) / (num_experts - hot_experts))
    p[:hot_experts] = hot_share / hot_experts
    rng = np.random.default_rng(seed)
    s = steps * num_gpus
    counts = rng.multinomial(tokens * top_k, p, size=(s, num_layers)).astype(np.int32)
    return SampleCounts(
        counts=counts,
        tokens=np.full(s, tokens, dtype=np.int64),
        batch_offsets=np.arange(0, s + 1, num_gpus, dtype=np.int64),
        top_k=top_k,
        meta={"source": "bench_node_hot", "dataset": f"hot{hot_experts}"},
    )


def run(overrides: list[str], counts: SampleCounts | None) -> tuple[float, float, float]:
    """(step seconds, moved (layer, expert) pairs per step, wall seconds) of one config."""
    with initialize_config_dir(str(CONF), version_base="1.3", job_name="node_hot"):
        cfg = compose("config", overrides=overrides)
    res, wall = timed_simulation(cfg, counts)
    return res.metrics["step_time_s"], res.metrics["reorder_moved_experts"], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--planners", default="megatron,ultraep,llep,relibra,relibra_portfolio")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hot-share", type=float, default=0.5)
    ap.add_argument("--quick-cells", action="store_true")
    ap.add_argument("--grid-cells", action="store_true")
    ap.add_argument("--no-node-hot", action="store_true")
    ap.add_argument(
        "--set", action="append", default=[],
        help="an extra row: LABEL=planner=NAME,KEY=V,... (overrides joined by commas)",
    )  # fmt: skip
    args = ap.parse_args()
    rows: list[tuple[str, list[str]]] = [(p, [f"planner={p}"]) for p in args.planners.split(",")]
    for spec in args.set:
        label, _, over = spec.partition("=")
        rows.append((label, over.split(",")))
    counts = hot_counts(128, 48, 8, 32, 128 * 8 // 32, args.steps, args.tokens, args.hot_share)
    cells: list[tuple[str, list[str], SampleCounts | None]] = []
    if not args.no_node_hot:
        cells.append(("node_hot", BASE, counts))
    if args.quick_cells:
        for preset in ("mixed", "reasoning"):
            cells.append(
                (f"quick {preset}", [*BASE, "+experiment=quick_overall", f"trace.preset={preset}"], None)
            )
    if args.grid_cells:
        steps = ["trace.num_batches=4", "trace.samples_per_batch=256", "trace.max_tokens=2048"]
        cells.append(("mixed 4 steps", [*BASE, "trace.preset=mixed", *steps], None))
    table = Table(
        title=f"Whole node hot (hot share {args.hot_share}), Qwen3-30B-A3B EP 32: step / force-balanced"
    )
    table.add_column("planner")
    for name, _, _ in cells:
        table.add_column(f"{name} ratio", justify="right")
        table.add_column(f"{name} moved/step", justify="right")
    fb = {name: run([*base, "planner=force_balanced"], c)[0] for name, base, c in cells}
    t0 = time.perf_counter()
    for label, over in rows:
        out = []
        for name, base, c in cells:
            step, moved, _ = run([*base, *over], c)
            out += [f"{step / fb[name]:.3f}", f"{moved:.0f}"]
        table.add_row(label, *out)
        console.print(f"{label}: {out} ({time.perf_counter() - t0:.0f} s)")
    console.print(table)


if __name__ == "__main__":
    main()
