"""UltraEP's minimum tokens per replica (``planner.min_tokens_per_replica``, upstream
``QUOTA_MIN_TOKENS_PER_REPLICA=1024``) swept over workloads, step time over force-balanced's.

Usage: ``python benchmarks/bench_ultraep_min_tokens.py [--values 64,128,...] [--steps S] [--tokens T]
[--no-quick-cell]``.

Workloads (Qwen3-30B-A3B at EP 32, ``S`` steps of one ``T``-token sample per GPU,
:func:`bench_node_hot.hot_counts`): balanced routing, a hot rank (GPU 0's 4 experts take 30 % of the slots,
so the excess can go to its node's other GPUs, UltraEP's domain) and a hot node (node 0's 32 experts take
50 %: no copy inside the node can help); and the paper's quick cell (``+experiment=quick_overall``, mixed,
8k-token rollouts). The floor only matters where a GPU's excess is split over several copies: a copy is
made only if it takes at least that many tokens, so at 1024 tokens per GPU the upstream default allows at
most one copy per overloaded GPU and expert.
"""

from __future__ import annotations

import argparse

from bench_node_hot import BASE, hot_counts, run
from rich.console import Console
from rich.table import Table

from relibra.types import SampleCounts

console = Console(width=160)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--values", default="32,128,256,512,1024")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--no-quick-cell", action="store_true")
    args = ap.parse_args()
    shapes = {"balanced": (32, 0.25), "hot rank": (4, 0.30), "hot node": (32, 0.50)}
    cells: list[tuple[str, list[str], SampleCounts | None]] = [
        (name, BASE, hot_counts(128, 48, 8, 32, hot, args.steps, args.tokens, share))
        for name, (hot, share) in shapes.items()
    ]
    if not args.no_quick_cell:
        cells.append(
            ("quick_overall mixed", [*BASE, "+experiment=quick_overall", "trace.preset=mixed"], None)
        )
    fb = {name: run([*base, "planner=force_balanced"], c)[0] for name, base, c in cells}
    table = Table(title="UltraEP min_tokens_per_replica, Qwen3-30B-A3B EP 32: step / force-balanced")
    table.add_column("planner")
    for name, _, _ in cells:
        table.add_column(name, justify="right")
    rows = [("megatron", ["planner=megatron"])] + [
        (f"ultraep min_tokens={v}", ["planner=ultraep", f"planner.min_tokens_per_replica={v}"])
        for v in args.values.split(",")
    ]
    for label, over in rows:
        ratios = [f"{run([*base, *over], c)[0] / fb[name]:.4f}" for name, base, c in cells]
        table.add_row(label, *ratios)
        console.print(label, ratios)
    console.print(table)


if __name__ == "__main__":
    main()
