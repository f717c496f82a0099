"""One RL training step of a tiny Megatron-core MoE model on CPU, with ReLibra's plan applied.

The template for plugging ReLibra into a Megatron-based RL trainer (verl, slime, NeMo-RL):

1. **rollout**: every rank runs its prompts through the model with ``RouterReplay`` in ``RECORD`` mode
   (a real trainer records in vLLM / SGLang and ships the routes with the responses);
2. **plan**: the routes of the whole batch become a routing trace, then per-sample counts, a workload and
   a batch context; a ReLibra planner returns the batch plan (placement, sample-to-GPU assignment,
   per-micro-batch replicas and token split). Rank 0 plans and broadcasts the plan;
3. **train**: the adapter moves experts to the plan's placement (weights, gradients, Adam state), then
   every micro-batch replays its recorded routes with the plan's replicas and split, and the optimizer
   steps. With ``--check`` the plain Megatron model trains the same step and the script reports the
   largest difference of losses and expert weights (float summation order only).

Run: ``python examples/megatron_rl_step.py`` (4 ranks, gloo, about 13 s on 2 CPU cores once numba's on-disk
cache holds the planner's kernels, plus about 25 s to compile them once);
``--planner relibra_replicate_only`` or ``megatron`` to compare, ``--samples 32`` for a larger batch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relibra.executors.torch_executor import launch
from relibra.megatron.model import TinyMoESpec

REPO = Path(__file__).resolve().parents[1]


def sample_input(s: int, tokens: int, hidden: int, seed: int, skew: float = 2.0) -> torch.Tensor:
    """The prompt+response hidden states of sample ``s`` (any rank can rebuild any sample).

    A direction shared by every token (scaled by ``skew``) makes a few experts hot, as in real RL batches.
    """
    shared = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    return (
        torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed * 100_003 + s))
        + skew * shared
    )


def make_planner(name: str, replica_slots: int) -> Any:
    # NOTE: refill_aware=False: the example's samples (8-48 tokens) are far too short for a copy's buffer
    # refill (priced at OLMoE-sized experts) to hide behind attention, so a refill-aware planner would copy
    # nothing; the example is here to show the replica path (relibra.planners.refill).
    from relibra.planners.replicate.greedy import GreedyConfig

    if name == "relibra":
        from relibra.planners.compose import relibra

        return relibra(replica_slots=replica_slots, replicate=GreedyConfig(refill_aware=False))
    if name == "relibra_replicate_only":
        from relibra.planners.compose import relibra_replicate_only

        return relibra_replicate_only(replica_slots=replica_slots, replicate=GreedyConfig(refill_aware=False))
    if name == "megatron":
        from baselines.megatron import MegatronPlanner

        return MegatronPlanner()
    raise ValueError(f"--planner {name!r}; expected relibra, relibra_replicate_only or megatron")


def plan_batch(sample_routes: list[np.ndarray], args: argparse.Namespace, world: int) -> tuple[Any, Any]:
    """Routes -> trace -> counts -> workload -> batch context -> plan (the control plane, on one rank)."""
    from relibra.megatron.planning import load_hardware, plan_routes, planning_specs

    cluster, model = planning_specs(
        load_hardware(REPO / "experiments/conf/cluster/hopper.yaml"),
        world,
        args.layers,
        args.experts,
        args.top_k,
    )
    planner = make_planner(args.planner, args.replica_slots)
    return plan_routes(sample_routes, planner, cluster, model, args.samples_per_microbatch)


def rl_step(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from relibra.megatron.model import TinyMoEModel, init_expert_parallel
    from relibra.megatron.planning import gpu_skew, microbatch_samples
    from relibra.megatron.replay import recorded_routes, recording, replaying
    from relibra.planners.protocols import home_assign, static_placement

    init_expert_parallel(world)
    spec = TinyMoESpec(args.layers, args.hidden, args.ffn, args.experts, args.top_k, seed=args.seed)
    models = {"relibra": TinyMoEModel(spec, world, replica_slots=args.replica_slots)}
    if args.check:
        models["plain"] = TinyMoEModel(spec, world)
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.min_tokens, args.max_tokens + 1, args.samples)
    reward = rng.standard_normal(args.samples)
    advantage = (reward - reward.mean()) / (reward.std() + 1e-6)

    # Step 1: rollout on the static placement, recording routes per sample (rank j generates samples j,
    # j+G, ...).
    policy = models["relibra"]
    mine = list(range(rank, args.samples, world))
    recorded = {}
    with torch.no_grad():
        for s in mine:
            with recording(policy.routers):
                policy(sample_input(s, int(lengths[s]), args.hidden, args.seed))
            recorded[s] = recorded_routes(policy.routers)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, recorded)
    routes = {s: r for part in gathered for s, r in part.items()}

    # Step 2: plan on rank 0 (a trainer would overlap this with post-rollout processing), broadcast.
    box: list[Any] = [None]
    if rank == 0:
        t0 = time.perf_counter()
        plan, ctx = plan_batch([routes[s] for s in range(args.samples)], args, world)
        static = home_assign(ctx.load, static_placement(args.layers, args.experts, world), world)
        box[0] = (plan, ctx.sample_mb, time.perf_counter() - t0, gpu_skew(static))
    dist.broadcast_object_list(box, src=0)
    plan, sample_mb, plan_s, static_skew = box[0]

    # Step 3: train on the plan: placement, then every micro-batch with its replicas and split.
    filled = 0 if plan.replicas is None else int((plan.replicas >= 0).sum())
    out: dict[str, Any] = {
        "plan_s": plan_s,
        "replicas": filled,
        "static_skew": static_skew,
        "plan_skew": gpu_skew(plan.assign),
    }
    for name, model in models.items():
        opt = torch.optim.Adam(model.trainable_parameters(), lr=1e-3)
        t0 = time.perf_counter()
        if model.adapter is not None:
            out["moved"] = model.adapter.apply_placement(plan.home, opt)
        losses = []
        for m in range(int(sample_mb.max()) + 1):
            samples = microbatch_samples(plan.sample_gpu, sample_mb, rank, m)
            if model.adapter is not None:
                model.adapter.set_microbatch(plan, m)
            parts = [sample_input(int(s), int(lengths[s]), args.hidden, args.seed) for s in samples]
            x = torch.cat([torch.zeros(0, args.hidden), *parts]).requires_grad_()
            mb_routes = np.concatenate(
                [np.zeros((0, args.layers, args.top_k), np.int64)] + [routes[s] for s in samples]
            )
            with replaying(mb_routes, model.routers, args.experts):
                y = model(x)
            # A policy-gradient stand-in: advantage-weighted mean of a fixed readout of each token.
            weight = torch.as_tensor(np.repeat(advantage[samples], lengths[samples]), dtype=y.dtype)
            loss = (weight * y.mean(dim=1)).sum() / max(1, int(lengths.sum()))
            loss.backward()
            losses.append(loss.item())
        opt.step()
        out[f"{name}_loss"] = losses
        out[f"{name}_train_s"] = time.perf_counter() - t0
        out[f"{name}_weights"] = [model.expert_state(layer) for layer in range(args.layers)]
    if "relibra" in models and models["relibra"].adapter is not None:
        out["buffer_bytes"] = models["relibra"].adapter.buffer.nbytes
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--planner", default="relibra")
    parser.add_argument("--replica-slots", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--ffn", type=int, default=16)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--samples-per-microbatch", type=int, default=2)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the step on ``--world`` ranks, print a summary and return it (with ``--check``: the differences
    ``max_loss_diff`` and ``max_weight_diff`` against the plain Megatron model)."""
    args = parse_args(argv)
    ranks = launch(rl_step, args.world, args)
    r0 = ranks[0]
    summary: dict[str, Any] = {
        key: r0[key] for key in ("plan_s", "moved", "replicas", "buffer_bytes", "static_skew", "plan_skew")
    }
    summary["train_s"] = max(r["relibra_train_s"] for r in ranks)
    print(
        f"planner {args.planner}: plan {r0['plan_s']:.2f} s, moved experts {r0['moved']}, "
        f"filled replica slots {r0['replicas']}, replica buffer {r0['buffer_bytes']} B per rank"
    )
    print(
        f"skewness (max/mean compute tokens per GPU) over (micro-batch, layer): static placement "
        f"mean {r0['static_skew'].mean():.3f}, plan mean {r0['plan_skew'].mean():.3f} "
        f"max {r0['plan_skew'].max():.3f}"
    )
    print(f"train step: relibra {summary['train_s']:.2f} s")
    if args.check:
        summary["max_loss_diff"] = max(
            abs(a - b) for r in ranks for a, b in zip(r["relibra_loss"], r["plain_loss"], strict=True)
        )
        summary["max_weight_diff"] = max(
            float(np.abs(r["relibra_weights"][layer][e] - q["plain_weights"][layer][e]).max())
            for layer in range(args.layers)
            for r in ranks
            for e in r["relibra_weights"][layer]
            for q in ranks
            if e in q["plain_weights"][layer]
        )
        print(
            f"check against plain Megatron: max |loss diff| {summary['max_loss_diff']:.2e}, "
            f"max |expert weight diff| {summary['max_weight_diff']:.2e}"
        )
    return summary


if __name__ == "__main__":
    main()
