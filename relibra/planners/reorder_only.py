"""Planner ``relibra_reorder_only``: ReLibra's inter-batch reordering without intra-batch replication.

The middle row of the paper's ablation: the annealer of :mod:`relibra.planners.reorder.anneal` chooses each
layer's placement (and, with ``locality=true``, a new sample-to-GPU assignment) once per batch; every token
is then computed at its expert's home (no replica slots); the plan is relabelled to keep experts where they
were (:func:`relibra.relabel.relabel_for`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from relibra.planners.protocols import BatchContext, SlotBudget, home_assign, reordered_load
from relibra.planners.reorder.anneal import AnnealingReorderer
from relibra.planners.reorder.config import AnnealConfig
from relibra.relabel import relabel_for
from relibra.types import BatchPlan

__all__ = ["ReorderOnlyPlanner"]


class ReorderOnlyPlanner:
    """Reordering plus home-only assignment (implements :class:`relibra.planners.protocols.Planner`);
    ``reorder``: the annealer's :class:`~relibra.planners.reorder.config.AnnealConfig` (default: its
    defaults)."""

    def __init__(
        self, name: str = "relibra_reorder_only", replica_slots: int = 0, reorder: AnnealConfig | None = None
    ) -> None:
        if replica_slots != 0:
            raise ValueError(
                f"planner.replica_slots={replica_slots}: relibra_reorder_only computes every expert at home; "
                "use 0 (or planner=relibra for replication)"
            )
        self.name = name
        self.replica_slots = 0
        self.reorderer = AnnealingReorderer(reorder)

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget()

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan: annealed home [L, E], home-only assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        reordering = self.reorderer.reorder(ctx)
        sample_gpu = np.asarray(reordering.sample_gpu, dtype=np.int32)
        load = reordered_load(ctx, sample_gpu, self.name)
        plan = BatchPlan(
            home=reordering.home,
            assign=home_assign(load, reordering.home, ctx.num_gpus),
            load=load.astype(np.int32, copy=False),
            sample_gpu=sample_gpu,
            stats=dict(reordering.stats),
        )
        # NOTE: the annealer re-plans from scratch; among equivalent relabellings keep experts in place.
        return replace(relabel_for(plan, ctx), plan_time_s=time.perf_counter() - t0)
