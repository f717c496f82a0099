"""Placement lifetime: for how many batches a reordering keeps its saving, the amortisation horizon of the
incremental reordering (``planner=relibra_portfolio``: ``planner.candidates.*.reorder.horizon``).

Usage: ``python benchmarks/bench_horizon.py [--model M] [--nodes N] [--presets a,b] [--batches B]
[--layers L] [--samples S]``.

For batches ``b = 0..B-1`` of a synthetic trace (the generator's per-batch drift of the routing bias stands
for the policy moving between RL steps, :mod:`relibra.trace.synthetic`), plan each batch's placement
``P_b`` from scratch with the paper's annealer (placement round only, default settings) and price every
placement on every later batch by the home-only ``T_MoE`` (the cost model, summed over micro-batches and
layers). The share of a fresh plan's saving over Megatron-LM's static placement ``S`` that ``P_b`` still
gives ``k`` batches later is

    r(k) = mean_b [T(S, b+k) - T(P_b, b+k)] / [T(S, b+k) - T(P_{b+k}, b+k)],   r(0) = 1.

A move made for batch ``b`` saves its batch's gain and then ``r(k)`` of a batch's gain ``k`` batches later,
so over its life it is worth ``H = sum_k r(k)`` batches of saving: the horizon over which the objective
spreads its migration. The sum stops at the last lag the trace measures (``B - 1``), so ``H`` is a lower
bound when ``r`` has not decayed by then. Home-only ``T_MoE`` leaves out the replication that follows
(which removes part of any placement's imbalance); the ratio ``r`` is what the horizon needs, not the size
of the saving.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import hardware, model
from rich.console import Console
from rich.table import Table

from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import home_assign, static_placement
from relibra.planners.reorder.anneal import AnnealingReorderer
from relibra.simulator import batch_context
from relibra.trace.synthetic import generate_counts
from relibra.workload import build_workload

console = Console(width=160)


def t_moe(cost: CostModel, load: np.ndarray, home: np.ndarray) -> float:
    """Home-only ``T_MoE`` seconds of load [Mb, L, G, E] under home [L, E], summed."""
    return float(cost.moe(load, home_assign(load, home, cost.cluster.num_gpus)).t_moe.sum())


def lifetime(
    preset: str, model_name: str, nodes: int, batches: int, layers: int, samples: int, max_tokens: int
) -> np.ndarray:
    """r(k) for k = 0..batches-1 (float64 [B]) on one synthetic trace."""
    cost = CostModel(ClusterSpec(nodes, 8, hardware()), model(model_name))
    m = cost.model
    g = cost.cluster.num_gpus
    counts = generate_counts(
        preset, m.num_experts, layers, m.top_k, batches, samples, seed=0, max_tokens=max_tokens
    )
    wl = build_workload(counts, g, samples_per_microbatch=max(1, samples // (g * 16)))
    loads = [batch_context(counts, wl, b, cost.cluster, m, cost).load for b in range(batches)]
    reorderer = AnnealingReorderer()
    plans = [
        reorderer.place(batch_context(counts, wl, b, cost.cluster, m, cost)).home for b in range(batches)
    ]
    static = static_placement(layers, m.num_experts, g)
    fresh = [t_moe(cost, loads[b], static) - t_moe(cost, loads[b], plans[b]) for b in range(batches)]
    r = np.full(batches, np.nan)
    for k in range(batches):
        kept = [
            (t_moe(cost, loads[b + k], static) - t_moe(cost, loads[b + k], plans[b])) / fresh[b + k]
            for b in range(batches - k)
            if fresh[b + k] > 0
        ]
        r[k] = float(np.mean(kept)) if kept else np.nan
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--presets", default="reasoning,mixed")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8, help="MoE layers of the model kept (the first L)")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=8192)
    args = ap.parse_args()
    table = Table(title=f"Placement lifetime r(k), {args.model} EP {8 * args.nodes}, {args.layers} layers")
    table.add_column("preset")
    for k in range(args.batches):
        table.add_column(f"r({k})", justify="right")
    table.add_column("H = sum r", justify="right")
    for preset in args.presets.split(","):
        r = lifetime(preset, args.model, args.nodes, args.batches, args.layers, args.samples, args.max_tokens)
        table.add_row(preset, *(f"{v:.2f}" for v in r), f"{np.nansum(r):.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
