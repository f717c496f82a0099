"""Round-robin expert placement: expert ``e`` on GPU ``e % G`` in every layer and batch, every token computed
at home.

Source: vLLM's ``expert_placement_strategy="round_robin"`` (``ParallelConfig``; ``determine_expert_map`` in
``vllm/model_executor/layers/fused_moe/layer.py``): EP rank ``r`` holds the experts ``r, r + G, r + 2G, ...``
instead of the contiguous block ``r * E / G ...`` of the default ``linear`` strategy (Megatron-LM's, here
:class:`baselines.megatron.MegatronPlanner`). Neighbouring expert ids land on different GPUs, which spreads
a hot run of adjacent experts; it reads no loads.

Choices the source leaves open, taken here: every layer is placed the same way (vLLM applies the strategy
only to models with expert groups, ``num_expert_group > 1``, and falls back to ``linear`` otherwise; here
it applies to every model); the first batch pays the migration from the contiguous placement the simulator
starts every planner from (as any planner whose placement differs does), later batches none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from relibra.planners.protocols import BatchContext, SlotBudget, home_assign, previous_home
from relibra.types import BatchPlan

__all__ = ["RoundRobinPlanner", "round_robin_placement"]


def round_robin_placement(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """vLLM's ``round_robin`` expert map: expert ``e`` on GPU ``e % G``. -> home int32 [L, E]."""
    return np.broadcast_to(np.arange(num_experts) % num_gpus, (num_layers, num_experts)).astype(np.int32)


@dataclass(frozen=True)
class RoundRobinPlanner:
    """Round-robin static placement with home-only assignment (no replica slots)."""

    name: str = "round_robin"

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget()

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with home [L, E] and assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        num_layers, num_experts = ctx.counts.shape[1:]
        home = round_robin_placement(num_layers, num_experts, ctx.num_gpus)
        moved = float((home != previous_home(ctx)).sum())
        return BatchPlan(
            home=home,
            assign=home_assign(ctx.load, home, ctx.num_gpus),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            plan_time_s=time.perf_counter() - t0,
            stats={"reorder_moved_experts": moved},
        )
