"""Round-robin placement against its source (vLLM's ``round_robin`` expert map), the plan invariants and the
migration its first batch pays."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from baselines.megatron import MegatronPlanner
from baselines.round_robin import RoundRobinPlanner, round_robin_placement
from relibra.invariants import check_plan
from tests.builders import make_ctx


def test_vllm_example() -> None:
    """8 experts on 2 ranks: rank 0 holds 0, 2, 4, 6 and rank 1 holds 1, 3, 5, 7 (``linear``: 0-3, 4-7)."""
    home = round_robin_placement(num_layers=2, num_experts=8, num_gpus=2)
    assert home.shape == (2, 8) and home.dtype == np.int32
    assert [np.flatnonzero(home[1] == r).tolist() for r in (0, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_plan_keeps_the_invariants_and_computes_every_token_at_home() -> None:
    ctx = make_ctx(nodes=2, gpus_per_node=4, num_experts=16, microbatches=3, samples=96)
    plan = RoundRobinPlanner().plan(ctx)
    check_plan(plan, ctx, replica_slots=0)
    assert (plan.home == np.arange(16) % 8).all()
    per_expert = ctx.load.sum(axis=2)  # [Mb, L, E]
    assert (plan.assign.sum(axis=-1) == per_expert).all()
    home_tokens = np.take_along_axis(plan.assign, plan.home[None, :, :, None], axis=-1)[..., 0]
    assert (home_tokens == per_expert).all()


def test_the_first_batch_moves_from_the_contiguous_placement_and_later_ones_do_not() -> None:
    """16 experts on 8 GPUs: only experts 0 and 15 keep their contiguous home (e // 2 == e % 8)."""
    ctx = make_ctx(nodes=2, gpus_per_node=4, num_experts=16, num_layers=3)
    first = RoundRobinPlanner().plan(ctx)
    static = MegatronPlanner().plan(ctx).home
    assert first.stats["reorder_moved_experts"] == (first.home != static).sum() == 3 * 14
    later = RoundRobinPlanner().plan(replace(ctx, prev_home=first.home))
    assert later.stats["reorder_moved_experts"] == 0
