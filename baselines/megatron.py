"""Megatron-LM's expert parallelism: static contiguous placement, every token computed at home.

Expert ``e`` lives on GPU ``e // (E / G)`` in every layer and batch; no replication, no reordering; tokens
travel by a plain all-to-all dispatch. This is the paper's baseline for throughput and skewness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from relibra.planners.protocols import BatchContext, SlotBudget, home_assign, static_placement
from relibra.types import BatchPlan

__all__ = ["MegatronPlanner"]


@dataclass(frozen=True)
class MegatronPlanner:
    """Static contiguous placement with home-only assignment (``replica_slots`` is always 0)."""

    name: str = "megatron"
    replica_slots: int = 0

    def __post_init__(self) -> None:
        if self.replica_slots != 0:
            raise ValueError(
                f"planner.replica_slots={self.replica_slots}: Megatron-LM has no replica slots; use 0"
            )

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(replica_slots=self.replica_slots)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with home [L, E] and assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        num_layers, num_experts = ctx.counts.shape[1:]
        home = static_placement(num_layers, num_experts, ctx.num_gpus)
        assign = home_assign(ctx.load, home, ctx.num_gpus)
        return BatchPlan(
            home=home,
            assign=assign,
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            plan_time_s=time.perf_counter() - t0,
            stats={"reorder_moved_experts": 0.0},
        )
