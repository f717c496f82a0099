"""Planning time per (micro-batch, layer) of the online planners (UltraEP, LLEP), as docs/baselines.md
quotes it: the time this implementation takes, beside the constant the simulator charges by default.

Usage (from the repository root): ``PYTHONPATH=. python benchmarks/bench_online.py [--model M] [--nodes N]``.
Default: Qwen3-235B-A22B at EP 64 (8 nodes of 8), one quick-scale batch (128 rollouts up to 8k tokens) of
the mixed preset. The first call compiles (or loads) the numba kernels and is not timed.
"""

from __future__ import annotations

import argparse

import numpy as np
from _common import hardware, model
from rich.console import Console
from rich.table import Table

from baselines.llep import LlepPlanner
from baselines.ultraep import UltraEPPlanner
from relibra.cluster import ClusterSpec
from relibra.cost import CostModel
from relibra.simulator import batch_context
from relibra.synthetic import generate_counts
from relibra.workload import build_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--preset", default="mixed")
    args = ap.parse_args()
    spec = model(args.model)
    cluster = ClusterSpec(nodes=args.nodes, gpus_per_node=8, hardware=hardware())
    counts = generate_counts(
        preset=args.preset,
        num_experts=spec.num_experts,
        num_layers=spec.num_moe_layers,
        top_k=spec.top_k,
        num_batches=1,
        samples_per_batch=128,
        seed=0,
        max_tokens=8192,
    )
    workload = build_workload(counts, cluster.num_gpus, samples_per_microbatch=2)
    ctx = batch_context(counts, workload, 0, cluster, spec, CostModel(cluster, spec))
    table = Table(title=f"planning per (micro-batch, layer), {args.model}, EP {cluster.num_gpus}")
    for col in ("planner", "median us", "p90 us", "charged by default us"):
        table.add_column(col)
    for planner, default in ((UltraEPPlanner(critical_path_s=None), UltraEPPlanner().critical_path_s),
                             (LlepPlanner(critical_path_s=None), LlepPlanner().critical_path_s)):  # fmt: skip
        plan = planner.plan(ctx)
        assert plan.online is not None
        t = plan.online.critical_path_s * 1e6
        table.add_row(
            planner.name, f"{np.median(t):.0f}", f"{np.percentile(t, 90):.0f}", f"{(default or 0) * 1e6:.0f}"
        )
    Console().print(table)


if __name__ == "__main__":
    main()
