"""Planning time per (micro-batch, layer) of the online planners (UltraEP, LLEP, ECHO), as
docs/online_baselines.md quotes it: the time this implementation takes, beside the constant the simulator
charges by default; and UltraEP's communication under the suite's proportional split rule against its own
locality-aware split.

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

from baselines.echo import EchoPlanner
from baselines.llep import LlepPlanner
from baselines.ultraep import UltraEPPlanner, solve_domain, split_sources
from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.simulator import batch_context
from relibra.trace.synthetic import generate_counts
from relibra.workload import build_workload


def own_split_traffic(load: np.ndarray, gpus_per_node: int, slots: int) -> np.ndarray:
    """Tokens each source sends each GPU under UltraEP's own per-rank split (``rank_quota_prefix``).

    load int [Mb, L, G, E] -> float64 [Mb, L, G(j), G(g)].
    """
    mb, num_layers, g, num_experts = load.shape
    ed = num_experts // g * gpus_per_node
    out = np.zeros((mb, num_layers, g, g))
    for m in range(mb):
        for layer in range(num_layers):
            for d in range(g // gpus_per_node):
                xd = np.asarray(load[m, layer, :, d * ed : (d + 1) * ed], dtype=np.int64)
                sol = solve_domain(xd.sum(axis=0), num_experts // g, slots)
                alloc = split_sources(xd, sol, first_rank=d * gpus_per_node)  # [G, Ed, C]
                e, c = np.nonzero(sol.host >= 0)
                np.add.at(out[m, layer].T, sol.host[e, c] + d * gpus_per_node, alloc[:, e, c].T)
    return out


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
                             (LlepPlanner(critical_path_s=None), LlepPlanner().critical_path_s),
                             (EchoPlanner(critical_path_s=None), EchoPlanner().critical_path_s)):  # fmt: skip
        plan = planner.plan(ctx)
        assert plan.online is not None
        t = plan.online.critical_path_s * 1e6
        table.add_row(
            planner.name, f"{np.median(t):.0f}", f"{np.percentile(t, 90):.0f}", f"{(default or 0) * 1e6:.0f}"
        )
    console = Console()
    console.print(table)
    ultra = UltraEPPlanner().plan(ctx)
    assert ultra.replicas is not None  # UltraEP replicates: its plans carry the replica placement
    cost = ctx.cost
    t_prop = cost.comm_time(cost.traffic(ultra.load, ultra.assign)).max(axis=-1).sum()
    t_own = cost.comm_time(own_split_traffic(ctx.load, 8, ultra.replicas.shape[-1])).max(axis=-1).sum()
    console.print(
        f"UltraEP t_comm of the batch: proportional split {t_prop:.4f} s, its own split {t_own:.4f} s "
        f"(x{t_prop / t_own:.4f})"
    )


if __name__ == "__main__":
    main()
