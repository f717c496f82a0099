"""Balanced: the ideal bound every planner is held against (docs/glossary.md; the paper's "Balanced").

Not a plan: a lower bound that no plan of the suite can beat in any term of the step time. Per
(micro-batch, layer):

* **compute** at its mean over GPUs: the layer's whole grouped-GEMM work (each expert's tokens in one GEMM,
  the cheapest way to compute them, since splitting an expert over copies never costs less) split evenly
  (:meth:`~relibra.cost.model.CostModel.compute_floor`, which also holds under the tiled GEMM model and the
  per-expert launches, ``cluster.hardware.gemm_model`` / ``per_expert_costs``);
* **communication** at its mean over GPUs of the traffic no plan can avoid, spread evenly: a GPU computes
  at most ``E / G + slots`` distinct experts of a layer (its home experts and ``slots`` replica or
  redundant copies), so at least the routed slots of a sample outside its ``E / G + slots`` most-used
  experts leave its GPU, and at least those outside its ``(E / G + slots) * gpus_per_node`` most-used
  experts leave its node, whichever GPU the sample is put on (so the bound holds for planners that move
  samples, like ReLibra's locality round). That traffic is split between NVLink and the rail NICs so that
  both finish together (more may cross nodes than must, never less), and every GPU sends and receives
  ``1 / G`` of it; the cost model prices it like any plan's traffic. Any plan's busiest GPU needs at
  least this mean. Under ``cluster.dispatcher=deepep`` a token crosses to a remote node, or fans out to a
  GPU, once for all of its experts there, so the same traffic counts ``1 / k`` message per routed slot;
* **attention and dense layers** at their mean over GPUs (the simulator gives every GPU the micro-batch's
  mean tokens and causal pairs, see :func:`relibra.simulator.simulate`).

Nothing migrates and nothing is refilled. The simulator prices it through the
:class:`~relibra.simulator.Bound` protocol; it writes no plan dump and its skewness is 1 by definition.
``tests/test_bounds.py`` checks the bound property against every planner on random workloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost.model import MoEBreakdown
from relibra.planners.protocols import BatchContext, SlotBudget

__all__ = ["BalancedBound", "unavoidable_traffic"]


def _outside_top(counts: np.ndarray, keep: int) -> np.ndarray:
    """Routed slots outside each row's ``keep`` most-used experts: counts [..., E] -> float64 [...]."""
    c = np.asarray(counts, dtype=np.float64)
    e = c.shape[-1]
    if keep >= e:
        return np.zeros(c.shape[:-1])
    top = np.partition(c, e - keep, axis=-1)[..., e - keep :].sum(axis=-1)
    return c.sum(axis=-1) - top


def unavoidable_traffic(ctx: BatchContext, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Routed slots that must leave their GPU and their node in every (micro-batch, layer).

    Args:
        ctx: the batch (``counts`` [Sb, L, E], ``sample_mb`` [Sb], ``num_microbatches`` Mb).
        slots: non-home experts a GPU may compute per (micro-batch, layer).
    Returns:
        (off_gpu float64 [Mb, L], off_node float64 [Mb, L]), summed over the micro-batch's samples.
    """
    counts = np.asarray(ctx.counts)
    _, num_layers, num_experts = counts.shape
    g, gpn = ctx.num_gpus, ctx.cluster.domain_gpus
    per_gpu = num_experts // g + slots
    off_gpu_s = _outside_top(counts, per_gpu)  # [Sb, L]
    off_node_s = _outside_top(counts, per_gpu * gpn)  # [Sb, L]
    mb = ctx.num_microbatches
    off_gpu = np.zeros((mb, num_layers))
    off_node = np.zeros((mb, num_layers))
    np.add.at(off_gpu, np.asarray(ctx.sample_mb), off_gpu_s)
    np.add.at(off_node, np.asarray(ctx.sample_mb), off_node_s)
    return off_gpu, off_node


@dataclass(frozen=True)
class BalancedBound:
    """Compute, communication and attention each at their mean over GPUs for each (micro-batch, layer)."""

    name: str = "balanced"
    replica_slots: int = 0
    slots: int = 2
    """Most non-home experts any compared planner computes on one GPU per (micro-batch, layer): ReLibra's
    replica slots, EPLB+'s / LPLB+'s redundant slots, PopFetcher's prefetch slots (2 in every preset)."""

    def __post_init__(self) -> None:
        if self.slots < 0:
            raise ValueError(f"planner.slots={self.slots}: expected >= 0")

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(replica_slots=self.replica_slots)

    def bound(self, ctx: BatchContext) -> MoEBreakdown:
        """ctx.load [Mb, L, G, E] -> breakdown with leading axes [Mb, L] (per-GPU terms all equal)."""
        g = ctx.num_gpus
        n, gpn = ctx.cluster.num_domains, ctx.cluster.domain_gpus
        cost = ctx.cost
        per_expert = ctx.load.sum(axis=-2)  # [Mb, L, E]
        # Step 1: the layer's whole grouped-GEMM work (with each expert's real token count), split evenly.
        work = cost.compute_floor(per_expert, g)  # [Mb, L]
        t_compute_gpu = np.repeat(work[..., None], g, axis=-1)  # [Mb, L, G]
        # Step 2: the unavoidable traffic, split over NVLink and NIC so both finish together.
        off_gpu, off_node = unavoidable_traffic(ctx, self.slots)  # [Mb, L]
        if cost.dispatcher == "deepep":
            # NOTE: DeepEP sends a token once to each remote node and once to each GPU it fans out to,
            # however many of its k experts wait there: a message carries at most k routed slots.
            off_gpu, off_node = off_gpu / ctx.model.top_k, off_node / ctx.model.top_k
        lin = cost.linear()
        if n == 1:
            inter = np.zeros_like(off_gpu)
        elif gpn == 1:
            inter = np.maximum(off_node, off_gpu)
        else:
            nic_share = lin.nvlink_s_per_token / (lin.nvlink_s_per_token + lin.rdma_s_per_token)
            inter = np.maximum(off_node, off_gpu * nic_share)
        intra = np.maximum(off_gpu - inter, 0.0)
        # Step 3: every GPU sends 1/G of it, intra-node to its node peers and inter-node on its own rail.
        gpus = np.arange(g)
        same_node = (gpus[:, None] // gpn) == (gpus[None, :] // gpn)
        same_rail = (gpus[:, None] % gpn) == (gpus[None, :] % gpn)
        peers = (same_node & ~same_rail).astype(np.float64) / max(gpn - 1, 1)  # [G, G]
        rails = (~same_node & same_rail).astype(np.float64) / max(n - 1, 1)  # [G, G]
        traffic = (intra / g)[..., None, None] * peers + (inter / g)[..., None, None] * rails
        return MoEBreakdown(t_compute_gpu=t_compute_gpu, t_comm_gpu=cost.comm_time(traffic))
