"""Balanced: the ideal bound every planner is held against (DESIGN.md; the paper's "Balanced").

Not a plan: every GPU computes exactly the mean share of the layer's expert work and every GPU sends and
receives a uniform share of the all-to-all traffic (each source sends ``1 / G`` of the mean per-GPU routed
tokens to every GPU). The simulator prices it through the :class:`~relibra.simulator.Bound` protocol; it
writes no plan dump, its skewness is 1 by definition, and it moves no experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost import MoEBreakdown
from relibra.planner import BatchContext, home_assign, static_placement

__all__ = ["BalancedBound"]


@dataclass(frozen=True)
class BalancedBound:
    """Perfect compute balance and uniform traffic for each (micro-batch, layer)."""

    name: str = "balanced"
    replica_slots: int = 0

    def bound(self, ctx: BatchContext) -> MoEBreakdown:
        """ctx.load [Mb, L, G, E] -> breakdown with leading axes [Mb, L] (per-GPU terms all equal)."""
        g = ctx.num_gpus
        cost = ctx.cost
        per_expert = ctx.load.sum(axis=-2)  # [Mb, L, E]
        # Step 1: the layer's whole grouped-GEMM work (with each expert's real token count), split evenly.
        work = cost.expert_time(per_expert).sum(axis=-1) / g  # [Mb, L]
        t_compute_gpu = np.repeat(work[..., None], g, axis=-1)  # [Mb, L, G]
        if cost.dispatcher == "deepep":
            # NOTE: DeepEP's volume depends on which experts share a node, so uniform traffic is no
            # ideal of it; instead each link direction at its mean over GPUs under Megatron's placement.
            home = static_placement(ctx.load.shape[1], ctx.load.shape[-1], g)
            comm = cost.mean_link_comm_time(ctx.load, home_assign(ctx.load, home, g))
            return MoEBreakdown(t_compute_gpu=t_compute_gpu, t_comm_gpu=comm)
        # Step 2: every source sends the mean routed tokens, spread evenly over all GPUs.
        mean_routed = ctx.load.sum(axis=(-2, -1)) / g  # [Mb, L]
        traffic = np.broadcast_to((mean_routed / g)[..., None, None], (*mean_routed.shape, g, g))
        return MoEBreakdown(t_compute_gpu=t_compute_gpu, t_comm_gpu=cost.comm_time(traffic))
