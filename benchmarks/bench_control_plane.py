"""Control plane: time from the last sample's arrival to all plans ready, against a post-rollout window.

Usage: ``python benchmarks/bench_control_plane.py [--full] [--layers N] [--workers 1,2] [--samples 512]
[--no-locality]``.

Qwen3-235B-A22B at EP 64 (8 nodes x 8 GPUs), one batch of the synthetic ``reasoning`` preset, ReLibra's
planner as the ``relibra`` preset runs it (annealing reordering with the locality round, then greedy
replication, ``replica_slots=2``; ``--no-locality`` drops the round). Samples arrive in 16 chunks
(``submit``), then ``seal``; the table reports, per worker count: time to first plan, time to all plans,
the summed task time (``plan_cpu_s``), the locality round's own seconds (one whole-batch task between
placement and replication), workload assembly, and the all-plans time extrapolated to ``C`` cores
(``assembly + locality + (cpu - locality) / C``: the per-layer tasks spread over the cores, 94 per phase,
while the locality round is one serial task).

By default only the first ``--layers`` (8) MoE layers are planned and times are scaled by ``94 / layers``
(layers are independent in placement and replication, and a move of the locality round costs O(L * G));
``--full`` plans all 94.

Post-rollout window (the assumption the target is held against): between rollout and the first training
micro-batch, the trainer runs a reference-model and an old-policy log-probability forward over the batch
(verl / slime / NeMo-RL GRPO and PPO recipes). Its length is estimated as two forward passes over the
batch's tokens at ``2 * active_params`` FLOPs per token on the EP group's GPUs at 40% of bf16 peak
(Hopper 989 TFLOP/s), reward computation ignored (it only lengthens the window).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import hardware
from _common import model as model_spec
from rich.console import Console
from rich.table import Table

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.cost.model import CostModel
from relibra.planners.compose import relibra
from relibra.planners.reorder.config import AnnealConfig
from relibra.trace.synthetic import generate_counts

ACTIVE_PARAMS = 22e9
"""Qwen3-235B-A22B's active parameters per token (model card)."""
MFU = 0.4
"""Assumed model FLOP utilisation of the log-probability forward passes."""


def post_rollout_window_s(tokens: int, cluster: ClusterSpec) -> float:
    """Seconds of two forward passes over ``tokens`` (reference + old-policy log-probabilities)."""
    flops = 2 * 2.0 * ACTIVE_PARAMS * tokens
    return flops / (cluster.num_gpus * cluster.hardware.bf16_flops * MFU)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="plan all 94 layers (default: --layers, scaled)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--samples-per-microbatch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-locality", action="store_true", help="reordering without the locality round")
    args = parser.parse_args()

    spec = model_spec("qwen3-235b-a22b")
    cluster = ClusterSpec(nodes=8, gpus_per_node=8, hardware=hardware())
    total_layers = spec.num_moe_layers
    layers = total_layers if args.full else min(args.layers, total_layers)
    model = ModelSpec(**{**spec.__dict__, "num_layers": layers, "num_moe_layers": layers})
    cost = CostModel(cluster, model)
    scale = total_layers / layers

    t0 = time.perf_counter()
    counts = generate_counts("reasoning", model.num_experts, layers, model.top_k, 1, args.samples, args.seed)
    gen_s = time.perf_counter() - t0
    tokens = int(counts.tokens.sum())
    window = post_rollout_window_s(tokens, cluster)
    console = Console(width=170)
    console.print(
        f"Qwen3-235B-A22B EP {cluster.num_gpus}: {args.samples} samples, {tokens} tokens "
        f"(mean {counts.tokens.mean():.0f}, max {counts.tokens.max()}), "
        f"{layers}/{total_layers} layers planned "
        f"(x{scale:.2f}), counts generated in {gen_s:.1f}s; post-rollout window estimate {window:.1f}s"
    )
    table = Table(title="control plane: seconds from the last arrival (scaled to 94 layers)")
    for col in (
        "workers",
        "micro-batches",
        "startup",
        "assembly",
        "first plan",
        "all plans",
        "task cpu",
        "locality",
        "per-core extrapolation: 2 / 8 / 32 cores",
        "fallbacks",
        "window",
    ):
        table.add_column(col, justify="right")
    order = np.random.default_rng(args.seed).permutation(args.samples)
    for workers in (int(w) for w in args.workers.split(",")):
        cfg = ControlPlaneConfig(workers=workers, samples_per_microbatch=args.samples_per_microbatch)
        planner = relibra(replica_slots=2, reorder=AnnealConfig(locality=not args.no_locality))
        with ControlPlane.from_planner(planner, cluster, model, cost, cfg) as cp:
            for chunk in np.array_split(order, 16):
                cp.submit(counts.counts[chunk], counts.tokens[chunk], sample_ids=chunk)
            batch = cp.seal()
            plan = cp.plans(batch)
            rep = cp.report(batch)
            startup = cp.startup_s
        cpu = rep.plan_cpu_s * scale
        asm = rep.assemble_s * scale
        loc = 0.0 if np.isnan(rep.locality_s) else rep.locality_s * scale
        per_core = " / ".join(f"{asm + loc + (cpu - loc) / c:.1f}" for c in (2, 8, 32))
        table.add_row(
            str(workers),
            str(plan.assign.shape[0]),
            f"{startup:.1f}",
            f"{asm:.2f}",
            f"{rep.time_to_first_plan_s:.2f}",
            f"{rep.time_to_all_plans_s * scale:.1f}",
            f"{cpu:.1f}",
            f"{loc:.2f} ({rep.locality})",
            per_core,
            str(int(rep.fallback.astype(bool).sum()) + int(rep.locality_fallback)),
            f"{window:.1f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
