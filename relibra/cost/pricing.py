"""The one place that prices a plan, as the simulator charges it and as planners that compare candidate
answers price them (the portfolio, the refill check, the overlap chain).

* per (micro-batch, layer): ``T_MoE`` (:meth:`~relibra.cost.model.CostModel.moe`), skewness, the
  replica-buffer refill and the part attention does not hide (:func:`attention_window`,
  :func:`layer_terms`, :func:`layer_price`);
* per batch (:func:`price_plan`, then :func:`batch_times`): attention and dense layers from the tokens and
  causal pairs each GPU holds, the MoE layers summed or overlapped (``cluster.ep_overlap``), an online
  planner's critical path, and every weight transfer of the plan as one schedule priced by one function
  (:mod:`relibra.cost.transfers`: replica fills and gradient returns, online copies, the migration of every
  expert whose home changed, the sync of permanent redundant copies); with
  ``simulator.step=whole`` the rest of the step (:mod:`relibra.cost.step`: permutation on the received
  slots, router, norms, LM head, recompute, optimizer, gradient reduction) and the RL step's forward-only
  passes (:mod:`relibra.cost.passes`); :func:`predict_batch_time` is the batch's seconds, equal to
  :func:`relibra.simulator.simulate`'s (``tests/test_joins.py``).

Planners' objectives price what a plan changes (``T_MoE``, the refill, the overlap, migration); the whole
step's other terms are priced here, after planning, so :func:`predict_batch_time` (which a planner may call
to compare whole plans) and the simulator agree by construction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from relibra.cost.model import CostModel, MoEBreakdown
from relibra.cost.overlap import OverlapNeighbours, microbatch_share
from relibra.cost.passes import forward_pass, token_work, update_pass
from relibra.cost.tensor import tp_group_mean
from relibra.cost.transfers import (
    TransferCharge,
    TransferSchedule,
    plan_transfers,
    price_transfers,
    redundant_transfer,
    refill_exposed,
    step_charge,
)
from relibra.cost.work import LayerWork
from relibra.parallel import rank_span
from relibra.planners.protocols import BatchContext, Replication, home_assign, static_placement
from relibra.types import BatchPlan
from relibra.workload import gpu_token_stats

__all__ = [
    "BatchTimes",
    "Priced",
    "attention_window",
    "batch_times",
    "layer_price",
    "layer_terms",
    "predict_batch_time",
    "price_plan",
    "redundant_sync_time",
    "skewness",
]


def skewness(compute_tokens: np.ndarray) -> np.ndarray:
    """``max_g / mean_g`` of per-GPU compute tokens [..., G] -> [...] (1.0 where nothing is computed)."""
    t = np.asarray(compute_tokens, dtype=np.float64)
    mean = t.mean(axis=-1)
    return np.divide(t.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)


def redundant_sync_time(plan: BatchPlan, cost: CostModel) -> float:
    """Seconds per step to reduce redundant copies' gradients home and broadcast updated weights back (the
    plan's ``redundant_sync`` transfer, :func:`relibra.cost.transfers.step_charge`)."""
    transfer = redundant_transfer(plan, cost)
    return 0.0 if transfer is None else step_charge(cost, transfer)[0]


@dataclass(frozen=True)
class Priced:
    """The costs of one batch beyond the MoE breakdown (internal)."""

    br: MoEBreakdown
    """Leading axes [Mb, L]."""
    skew: np.ndarray
    """float64 [Mb, L]."""
    tokens: np.ndarray
    """int64 [Mb, G]: tokens each GPU holds (after any sample re-assignment; a bound: float64, the mean)."""
    pairs: np.ndarray
    """float64 [Mb, G]: causal attention pairs each GPU holds."""
    transfers: TransferSchedule
    """Every weight transfer of the batch (replica fills, gradient returns, online copies, migration,
    redundant sync), priced by :func:`relibra.cost.transfers.price_transfers` in :func:`batch_times`."""
    critical_path_s: float = 0.0
    """An online planner's planning seconds on the critical path, summed over (micro-batch, layer)
    (``OnlineCopies.critical_path_s``); 0 for a plan made before the batch."""
    permute: np.ndarray | None = None
    """float64 [Mb, L]: ``max_g`` permutation and SwiGLU seconds on the received slots (None: 0, the MoE-only
    step)."""
    cast: np.ndarray | None = None
    """float64 [Mb, L]: ``max_g`` FP8 cast seconds of the expert GEMMs on the received slots (None: 0, bf16
    or the MoE-only step)."""
    reference: LayerWork | None = None
    """The reference model's forward work on Megatron's static placement (``workload.rl_passes`` holds
    ``reference``; None otherwise)."""

    def work(self) -> LayerWork:
        """The plan's own MoE work."""
        permute = np.zeros(self.br.t_compute.shape) if self.permute is None else self.permute
        return LayerWork(compute=self.br.t_compute, comm=self.br.t_comm, permute=permute, cast=self.cast)


def permute_seconds(
    cost: CostModel, received: np.ndarray, assign: np.ndarray | None = None
) -> np.ndarray | None:
    """float64 [Mb, L]: the busiest GPU's permutation seconds for received slots [Mb, L, G]; None for the
    MoE-only step. With the plan's ``assign`` [Mb, L, E, G] and ``cluster.hardware.per_expert_costs``, each
    GPU's receive-side routing map over its hosted experts joins it (:meth:`CostModel.routing_map_time`)."""
    if cost.training is None or not cost.training.whole:
        return None
    t = cost.permute_time(received)
    if assign is not None and cost.cluster.hardware.per_expert_costs:
        t = t + cost.routing_map_time(assign)
    return np.asarray(t.max(axis=-1))


def cast_seconds(cost: CostModel, received: np.ndarray) -> np.ndarray | None:
    """float64 [Mb, L]: the busiest GPU's FP8 cast seconds of the expert GEMMs for received slots [Mb, L,
    G]; None in bf16 and for the MoE-only step (nothing to add, so bf16 sums keep their bits)."""
    if cost.training is None or not cost.training.whole or cost.cluster.precision != "fp8":
        return None
    return np.asarray(cost.expert_cast_time(received).max(axis=-1))


def reference_work(cost: CostModel, load: np.ndarray) -> LayerWork | None:
    """The reference model's forward work for load [Mb, L, G, E] on Megatron's static placement, or None
    when ``workload.rl_passes`` has no ``reference`` pass."""
    if cost.training is None or "reference" not in cost.training.rl_passes:
        return None
    _, num_layers, g, num_experts = np.shape(load)
    assign = home_assign(np.asarray(load), static_placement(num_layers, num_experts, g), g)
    br = cost.moe(load, assign)
    received = assign.sum(axis=-2)
    permute = permute_seconds(cost, received, assign)
    return LayerWork(
        br.t_compute,
        br.t_comm,
        np.zeros(br.t_compute.shape) if permute is None else permute,
        cast=cast_seconds(cost, received),
    )


def price_plan(plan: BatchPlan, ctx: BatchContext, cost: CostModel, prev_home: np.ndarray) -> Priced:
    """The plan's costs; moves from ``prev_home`` [L, E] are priced with ``cost.migration``."""
    br = cost.moe(plan.load, plan.assign)
    received = plan.assign.sum(axis=-2)  # [Mb, L, G]: expert slots each GPU computes
    tokens, pairs = gpu_token_stats(
        ctx.sample_tokens,
        plan.sample_gpu,
        ctx.sample_mb,
        ctx.num_microbatches,
        ctx.num_gpus,
        rank_span(ctx.model.attention_span, ctx.cost.parallel),
    )
    return Priced(
        br=br,
        skew=skewness(received),
        tokens=tokens,
        pairs=pairs,
        transfers=plan_transfers(plan, cost, prev_home),
        critical_path_s=0.0 if plan.online is None else float(np.sum(plan.online.critical_path_s)),
        permute=permute_seconds(cost, received, plan.assign),
        cast=cast_seconds(cost, received),
        reference=reference_work(cost, plan.load),
    )


@dataclass(frozen=True)
class BatchTimes:
    attn: np.ndarray
    """float64 [Mb, 1]: attention seconds per micro-batch and layer (the busiest GPU's)."""
    sync: np.ndarray
    """float64 [Mb, L]: exposed seconds of the per-layer transfers (replica fill and gradient return, or an
    online planner's copies)."""
    dense: float
    """Seconds of the dense (non-MoE) layers."""
    critical: float
    """Planning seconds on the critical path (online planners), summed over (micro-batch, layer)."""
    comm_exposed: float
    """All-to-all seconds not hidden behind compute (all of them without ``cluster.ep_overlap``)."""
    total: float
    """The batch's seconds: every pass of ``workload.rl_passes`` (the update: per-layer MoE, attention and
    exposed sync, dense layers, migration, redundant, and the whole step's terms)."""
    parts: dict[str, float]
    """Seconds of the whole step's named terms and of each pass (result columns ``t_*_s``, this batch)."""
    transfers: TransferCharge
    """The priced transfer schedule (exposed and hidden seconds per kind, migration bytes)."""


def batch_times(priced: Priced, cost: CostModel, dense_layers: int) -> BatchTimes:
    tw = token_work(cost, priced.tokens, priced.pairs)
    attn = tw.attn  # [Mb, 1]
    charge = price_transfers(priced.transfers, cost, attn)
    sync = charge.layer_exposed
    critical = priced.critical_path_s
    work = priced.work()
    fixed = (
        float(sync.sum()),
        charge.step_exposed("migration"),
        charge.step_exposed("redundant_sync"),
        critical,
    )
    update = update_pass(cost, work, tw, dense_layers, fixed)
    parts = dict(update.parts, t_pass_update_s=update.total, t_pass_recompute_s=0.0, t_pass_reference_s=0.0)
    passes = cost.training.rl_passes if cost.training is not None else ("update",)
    if "recompute" in passes:
        # NOTE: the forward fill of the replica slots (or an online planner's copies after routing) and its
        # critical path recur; the backward's gradient return does not.
        fill = charge.recompute_exposed
        parts["t_pass_recompute_s"] = forward_pass(cost, work, tw, dense_layers, float(fill.sum()) + critical)
    if "reference" in passes:
        assert priced.reference is not None
        parts["t_pass_reference_s"] = forward_pass(cost, priced.reference, tw, dense_layers, 0.0)
    total = update.total + parts["t_pass_recompute_s"] + parts["t_pass_reference_s"]
    return BatchTimes(
        attn=attn,
        sync=sync,
        dense=dense_layers * float(tw.dense.sum()),
        critical=critical,
        comm_exposed=update.comm_exposed,
        total=total,
        parts=parts,
        transfers=charge,
    )


def predict_batch_time(plan: BatchPlan, ctx: BatchContext) -> float:
    """Seconds of one batch under ``plan``, priced by ``ctx.cost`` exactly as :func:`simulate` prices it.

    The migration is charged from ``ctx.prev_home`` (Megatron's static placement when None, the first
    batch), as the simulator does, with ``ctx.cost.migration``. A planner may call this to compare
    candidate plans of one batch (:class:`relibra.planners.portfolio.PortfolioPlanner`).
    """
    prev = ctx.prev_home
    if prev is None:
        _, num_layers, _, num_experts = np.shape(ctx.load)
        prev = static_placement(num_layers, num_experts, ctx.num_gpus)
    priced = price_plan(plan, ctx, ctx.cost, np.asarray(prev))
    return batch_times(priced, ctx.cost, ctx.model.num_layers - ctx.model.num_moe_layers).total


def attention_window(ctx: BatchContext, sample_gpu: np.ndarray) -> np.ndarray:
    """float64 [Mb]: one layer's attention seconds (fwd + bwd) on the busiest GPU of each micro-batch.

    ``sample_gpu`` [Sb] is the assignment the plan runs with (after the locality round, if any).
    """
    tokens, pairs = gpu_token_stats(
        ctx.sample_tokens,
        sample_gpu,
        ctx.sample_mb,
        ctx.num_microbatches,
        ctx.num_gpus,
        rank_span(ctx.model.attention_span, ctx.cost.parallel),
    )
    attn = ctx.cost.attention_time(tokens, pairs)
    if ctx.cost.parallel.tp > 1:  # a tensor-parallel group's mean (relibra.cost.tensor)
        attn = tp_group_mean(attn, ctx.cost.parallel.tp)
    return np.asarray(attn.max(axis=-1), dtype=np.float64)


def layer_terms(
    load: np.ndarray, home: np.ndarray, rep: Replication, ctx: BatchContext, window_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 [L] each: ``max_g T_comp``, ``max_g T_comm`` and the exposed refill of each layer, as the
    simulator charges them."""
    cost = ctx.cost
    br = cost.moe(load, rep.assign)
    return br.t_compute, br.t_comm, refill_exposed(cost, rep.replicas, home, window_s)


def layer_price(
    load: np.ndarray,
    home: np.ndarray,
    rep: Replication,
    ctx: BatchContext,
    window_s: float,
    overlap: OverlapNeighbours | None = None,
) -> np.ndarray:
    """float64 [L]: ``T_comp + T_comm + exposed refill`` of each layer, as the simulator charges it; with
    ``overlap`` the layer's share of the overlapped time (:func:`relibra.cost.overlap.microbatch_share`,
    compute with attention) plus the exposed refill."""
    comp, comm, exposed = layer_terms(load, home, rep, ctx, window_s)
    if overlap is None:
        return comp + comm + exposed
    share = [
        microbatch_share(c + a, k, nb, math.inf, overlap.contention)
        for c, k, a, nb in zip(comp, comm, overlap.attention, overlap.neighbours, strict=True)
    ]
    return np.asarray(share) + exposed
