"""The simulated executor: runs a planner batch by batch over a workload and prices every plan.

For each batch ``b`` the simulator builds a :class:`~relibra.planners.protocols.BatchContext` (oracle loads,
the previous placement, recent history, a ``regroup`` closure; :func:`relibra.workload.batch_context`), calls
the planner, times it, and prices the plan with the :class:`~relibra.cost.model.CostModel`:

* per (micro-batch, layer): ``T_MoE = max_g T_comp + max_g T_comm`` (:meth:`CostModel.moe`), attention
  ``max_g T_attn(g)``, and the exposed replica-buffer refill ``max(0, refill - attn_fwd) +
  max(0, refill - attn_bwd)`` (forward fill, backward gradient reduction, each hidden behind the layer's
  attention of that pass); for an online planner's plan (``BatchPlan.online``: UltraEP, LLEP) its
  planning time on the critical path (``t_critical_path_s``) and its weight copies, priced on the fabric
  and charged as :class:`~relibra.types.OnlineCopies` says (after routing, not behind attention);
* per batch: dense (non-MoE) layers, reordering migration of every expert whose home changed (weights,
  and optimizer state, :class:`~relibra.cost.migration.MigrationPayload`), and the gradient reduction plus
  weight broadcast of permanent redundant copies (EPLB+, LPLB+).

A batch is one RL training step: ``step_time_s`` is the mean batch time and throughput is all tokens over
all batch time. An ideal :class:`Bound` (Balanced) has no plan: it prices each (micro-batch, layer)
directly and its skewness is 1 by definition.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.migration import DEFAULT_BYTES_PER_PARAM
from relibra.cost.model import CostModel, MoEBreakdown
from relibra.cost.overlap import overlapped_time
from relibra.executors.protocol import ExecutionReport
from relibra.invariants import check_plan
from relibra.planners.protocols import BatchContext, Planner, SlotBudget, static_placement
from relibra.types import BatchPlan, OnlineCopies, SampleCounts, Workload
from relibra.workload import batch_context, gpu_token_stats

__all__ = [
    "Bound",
    "CostModelExecutor",
    "SimOptions",
    "SimResult",
    "batch_context",
    "predict_batch_time",
    "simulate",
    "skewness",
]

METRIC_COLUMNS = (
    "step_time_s",
    "throughput_tokens_per_s",
    "skew_mean",
    "skew_p50",
    "skew_p90",
    "skew_max",
    "plan_time_s",
    "replica_buffer_bytes",
    "reorder_moved_experts",
    "migration_bytes",
    "t_compute_s",
    "t_comm_s",
    "t_sync_exposed_s",
    "t_reorder_s",
    "t_attention_s",
    "t_critical_path_s",
)


@runtime_checkable
class Bound(Protocol):
    """An ideal that prices a batch without a plan (Balanced). ``name`` is the result-table label."""

    @property
    def name(self) -> str: ...

    @property
    def slot_budget(self) -> SlotBudget: ...

    def bound(self, ctx: BatchContext) -> MoEBreakdown:
        """Breakdown with leading axes [Mb, L] for the batch's loads ``ctx.load`` [Mb, L, G, E]."""
        ...


@dataclass(frozen=True)
class SimOptions:
    """Knobs of a simulation run (not of the cost model)."""

    migration_bytes_per_param: float = DEFAULT_BYTES_PER_PARAM
    history_window: int = 4
    """Batches of past loads handed to planners in ``BatchContext.history``."""
    keep_plans: bool = False
    seed: int = 0
    check_plans: bool = False
    """Run :func:`~relibra.invariants.check_plan` on every plan, within the planner's ``slot_budget``."""


@dataclass(frozen=True)
class SimResult:
    """What one planner run over a workload produced."""

    planner: str
    metrics: dict[str, float]
    """The DESIGN.md result columns (:data:`METRIC_COLUMNS`) plus planner stats (means over batches)."""
    skew: np.ndarray
    """float64 [M, L]: skewness of each (micro-batch, layer)."""
    t_compute: np.ndarray
    """float64 [M, L]: ``max_g T_comp`` seconds."""
    t_comm: np.ndarray
    """float64 [M, L]: ``max_g T_comm`` seconds."""
    t_attention: np.ndarray
    """float64 [M, L]: ``max_g`` attention seconds of the MoE layer."""
    t_sync_exposed: np.ndarray
    """float64 [M, L]: exposed replica-refill seconds."""
    batch_time: np.ndarray
    """float64 [B]: seconds of each batch (step)."""
    mb_batch: np.ndarray
    """int32 [M]: batch of each micro-batch."""
    plans: tuple[BatchPlan, ...] = ()
    """The plans, one per batch, when ``SimOptions.keep_plans``; empty otherwise (and for a Bound)."""

    def per_layer(self) -> pd.DataFrame:
        """One row per (micro-batch, layer): batch, micro_batch, layer, skew and the time terms."""
        m, l = self.skew.shape
        mm, ll = np.meshgrid(np.arange(m), np.arange(l), indexing="ij")
        return pd.DataFrame(
            {
                "planner": self.planner,
                "batch": self.mb_batch[mm.ravel()],
                "micro_batch": mm.ravel(),
                "layer": ll.ravel(),
                "skew": self.skew.ravel(),
                "t_compute_s": self.t_compute.ravel(),
                "t_comm_s": self.t_comm.ravel(),
                "t_attention_s": self.t_attention.ravel(),
                "t_sync_exposed_s": self.t_sync_exposed.ravel(),
            }
        )


def skewness(compute_tokens: np.ndarray) -> np.ndarray:
    """``max_g / mean_g`` of per-GPU compute tokens [..., G] -> [...] (1.0 where nothing is computed)."""
    t = np.asarray(compute_tokens, dtype=np.float64)
    mean = t.mean(axis=-1)
    return np.divide(t.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)


def _replicas_per_slot(plan: BatchPlan) -> np.ndarray:
    """int32 [Mb, L, G, r]: the plan's replica slots, or the non-home experts it computes when unlisted."""
    if plan.replicas is not None:
        return np.asarray(plan.replicas)
    g = plan.assign.shape[-1]
    non_home = (plan.assign > 0) & (plan.home[None, :, :, None] != np.arange(g))  # [Mb, L, E, G]
    if plan.redundant is not None:
        # NOTE: copies in permanent redundant slots are not refilled per layer.
        held = np.zeros(non_home.shape[1:], dtype=bool)  # [L, E, G]
        l, gg, _ = np.nonzero(plan.redundant >= 0)
        held[l, plan.redundant[plan.redundant >= 0], gg] = True
        non_home &= ~held[None]
    r = int(non_home.sum(axis=2).max()) if non_home.size else 0
    out = np.full((*non_home.shape[:2], g, max(r, 0)), -1, dtype=np.int32)
    if r:
        m, l, e, gg = np.nonzero(non_home)
        key = (m * non_home.shape[1] + l) * g + gg
        order = np.argsort(key, kind="stable")
        key, e = key[order], e[order]
        start = np.r_[0, np.flatnonzero(np.diff(key)) + 1]
        slot = np.arange(key.size) - np.repeat(start, np.diff(np.r_[start, key.size]))
        out.reshape(-1, r)[key, slot] = e
    return out


def _redundant_sync_time(plan: BatchPlan, cost: CostModel) -> float:
    """Seconds per step to reduce redundant copies' gradients home and broadcast updated weights back."""
    if plan.redundant is None or not (plan.redundant >= 0).any():
        return 0.0
    l, g, _ = np.nonzero(plan.redundant >= 0)
    experts = plan.redundant[plan.redundant >= 0]
    src = plan.home[l, experts]
    grad_bytes = cost.expert_weight_bytes()  # bf16 gradients, like the weights
    return 2.0 * cost.transfer_time(g, src, grad_bytes)


class CostModelExecutor:
    """The cost model behind the :class:`~relibra.executors.protocol.Executor` seam (``executor=sim``)."""

    name = "sim"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def execute(self, plans: Sequence[BatchPlan], model: ModelSpec, cluster: ClusterSpec) -> ExecutionReport:
        times = [self.cost.moe(p.load, p.assign).t_moe for p in plans]
        return ExecutionReport(moe_time_s=np.concatenate(times, axis=0))


@dataclass(frozen=True)
class _Priced:
    """The costs of one batch beyond the MoE breakdown (internal)."""

    br: MoEBreakdown
    """Leading axes [Mb, L]."""
    skew: np.ndarray
    """float64 [Mb, L]."""
    tokens: np.ndarray
    """int64 [Mb, G]: tokens each GPU holds (after any sample re-assignment; a bound: float64, the mean)."""
    pairs: np.ndarray
    """float64 [Mb, G]: causal attention pairs each GPU holds."""
    refill: np.ndarray
    """float64 [Mb, L]: one-direction replica-buffer refill seconds."""
    buffer_slots: int = 0
    moved: int = 0
    migration_bytes: float = 0.0
    """Bytes the EP group moves to re-home ``moved`` experts (payload: :mod:`relibra.cost.migration`)."""
    t_migration: float = 0.0
    t_redundant: float = 0.0
    online: OnlineCopies | None = None
    """An online planner's critical-path record (UltraEP, LLEP); None: copies refilled behind attention."""


def _price_bound(bound: Bound, ctx: BatchContext, workload: Workload, rows: slice) -> _Priced:
    br = bound.bound(ctx)
    g = workload.tokens.shape[1]
    # NOTE: an ideal has attention and dense layers at their mean over GPUs too: each GPU holds the mean
    # tokens and causal pairs of its micro-batch (both times are linear in them), whatever the layout.
    tokens = np.repeat(workload.tokens[rows].mean(axis=1, keepdims=True), g, axis=1)
    pairs = np.repeat(workload.causal_pairs[rows].mean(axis=1, keepdims=True), g, axis=1)
    return _Priced(
        br=br,
        skew=np.ones(br.t_compute.shape),
        tokens=tokens,
        pairs=pairs,
        refill=np.zeros(br.t_compute.shape),
    )


def _price_plan(
    plan: BatchPlan, ctx: BatchContext, cost: CostModel, prev_home: np.ndarray, bytes_per_param: float
) -> _Priced:
    br = cost.moe(plan.load, plan.assign)
    tokens, pairs = gpu_token_stats(
        ctx.sample_tokens, plan.sample_gpu, ctx.sample_mb, ctx.num_microbatches, ctx.num_gpus
    )
    reps = _replicas_per_slot(plan)  # [Mb, L, G, r]
    moved_l, moved_e = np.nonzero(plan.home != prev_home)
    # NOTE: an online planner's copies may leave the node (LLEP), so they are priced on the whole fabric.
    fill = cost.fabric_copy_time if plan.online is not None else cost.replica_refill_time
    expert_bytes = ctx.model.expert_params * bytes_per_param
    return _Priced(
        br=br,
        skew=skewness(plan.assign.sum(axis=-2)),
        tokens=tokens,
        pairs=pairs,
        refill=fill(reps, plan.home) if reps.size else np.zeros(br.t_compute.shape),
        buffer_slots=int((reps >= 0).sum(axis=-1).max()) if reps.size else 0,
        moved=int(moved_l.size),
        migration_bytes=float(moved_l.size * expert_bytes),
        t_migration=cost.transfer_time(
            prev_home[moved_l, moved_e], plan.home[moved_l, moved_e], expert_bytes
        ),
        t_redundant=_redundant_sync_time(plan, cost),
        online=plan.online,
    )


@dataclass(frozen=True)
class _BatchTimes:
    attn: np.ndarray
    """float64 [Mb, 1]: attention seconds per micro-batch and layer (the busiest GPU's)."""
    sync: np.ndarray
    """float64 [Mb, L]: exposed replica-buffer refill and gradient reduction."""
    dense: float
    """Seconds of the dense (non-MoE) layers."""
    critical: float
    """Planning seconds on the critical path (online planners), summed over (micro-batch, layer)."""
    comm_exposed: float
    """All-to-all seconds not hidden behind compute (all of them without ``cluster.ep_overlap``)."""
    total: float
    """The batch's seconds: per-layer MoE, attention and exposed sync, dense layers, migration, redundant."""


def _batch_times(priced: _Priced, cost: CostModel, dense_layers: int) -> _BatchTimes:
    attn_gpu = cost.attention_time(priced.tokens, priced.pairs)  # [Mb, G]
    attn = attn_gpu.max(axis=-1)[:, None]  # [Mb, 1]
    sync = cost.exposed_refill(priced.refill, attn) if priced.online is None else _online_sync(priced, attn)
    critical = 0.0 if priced.online is None else float(np.sum(priced.online.critical_path_s))
    dense = dense_layers * float((attn_gpu + cost.dense_ffn_time(priced.tokens)).max(axis=-1).sum())
    comp = priced.br.t_compute + attn  # [Mb, L]
    comm = float(priced.br.t_comm.sum())
    if cost.cluster.ep_overlap:
        moe, exposed = overlapped_time(comp, priced.br.t_comm)
    else:
        moe, exposed = float(comp.sum()) + comm, comm
    total = moe + float(sync.sum()) + dense + priced.t_migration + priced.t_redundant + critical
    return _BatchTimes(
        attn=attn, sync=sync, dense=dense, critical=critical, comm_exposed=exposed, total=total
    )


def _online_sync(priced: _Priced, attn: np.ndarray) -> np.ndarray:
    """Exposed copy seconds [Mb, L] of an online planner: ``exposed_copies`` full passes after routing, plus
    the excess of a gradient reduction that overlaps the backward attention (two thirds of fwd + bwd)."""
    online = priced.online
    assert online is not None
    sync = online.exposed_copies * priced.refill
    if online.overlapped_gradient_reduce:
        sync = sync + np.maximum(priced.refill - 2 * attn / 3, 0)
    return np.asarray(sync)


def predict_batch_time(
    plan: BatchPlan, ctx: BatchContext, bytes_per_param: float = DEFAULT_BYTES_PER_PARAM
) -> float:
    """Seconds of one batch under ``plan``, priced by ``ctx.cost`` exactly as :func:`simulate` prices it.

    The migration is charged from ``ctx.prev_home`` (Megatron's static placement when None, the first
    batch), as the simulator does. A planner may call this to compare candidate plans of one batch
    (:class:`relibra.planners.portfolio.PortfolioPlanner`).
    """
    prev = ctx.prev_home
    if prev is None:
        _, num_layers, _, num_experts = np.shape(ctx.load)
        prev = static_placement(num_layers, num_experts, ctx.num_gpus)
    priced = _price_plan(plan, ctx, ctx.cost, np.asarray(prev), bytes_per_param)
    return _batch_times(priced, ctx.cost, ctx.model.num_layers - ctx.model.num_moe_layers).total


def simulate(
    planner: Planner | Bound,
    counts: SampleCounts,
    workload: Workload,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    options: SimOptions | None = None,
) -> SimResult:
    """Run ``planner`` over every batch of ``workload`` and price it.

    Args:
        planner: a :class:`~relibra.planners.protocols.Planner` (returns plans) or a :class:`Bound`
        (Balanced). counts: per-sample counts [S, L, E] behind ``workload``; workload: loads [M, L, G, E] and
        layout. cluster, model, cost: the EP group, the model shape and the cost model that prices plans.
    Returns:
        :class:`SimResult` with the DESIGN.md metrics and per-(micro-batch, layer) arrays [M, L].
    """
    opt = options or SimOptions()
    shape = (workload.num_microbatches, counts.num_layers)
    skew, t_comp, t_comm, t_attn, t_sync = (np.zeros(shape) for _ in range(5))
    batch_time = np.zeros(counts.num_batches)
    totals = dict.fromkeys(
        ("reorder", "redundant", "dense", "plan", "moved", "critical", "migration_bytes", "exposed"), 0.0
    )
    budget = planner.slot_budget
    slots = {"buffer": budget.replica_slots, "redundant": 0}
    stats_sum: dict[str, float] = {}
    kept: list[BatchPlan] = []
    history: list[np.ndarray] = []
    # NOTE: the model starts in Megatron's placement, so moving away from it in batch 0 is charged too.
    prev_home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    planner_prev: np.ndarray | None = None
    dense_layers = model.num_layers - model.num_moe_layers

    for b in range(counts.num_batches):
        window = tuple(history[-opt.history_window :]) if opt.history_window else ()
        ctx = batch_context(
            counts, workload, b, cluster, model, cost, prev_home=planner_prev, history=window, seed=opt.seed
        )
        mbs = workload.batch_microbatches(b)
        rows = slice(int(mbs[0]), int(mbs[-1]) + 1)
        t0 = time.perf_counter()
        if isinstance(planner, Bound) and not isinstance(planner, Planner):
            priced = _price_bound(planner, ctx, workload, rows)
            totals["plan"] += time.perf_counter() - t0
            history.append(ctx.load)
        else:
            plan = planner.plan(ctx)  # type: ignore[union-attr]
            elapsed = time.perf_counter() - t0
            totals["plan"] += plan.plan_time_s if plan.plan_time_s > 0 else elapsed
            if opt.check_plans:
                check_plan(
                    plan,
                    ctx,
                    replica_slots=budget.replica_slots,
                    redundant_slots=budget.redundant_slots,
                    replicas_in_home_node=budget.replicas_in_home_node,
                )
            priced = _price_plan(plan, ctx, cost, prev_home, opt.migration_bytes_per_param)
            prev_home = planner_prev = plan.home
            if plan.redundant is not None:
                slots["redundant"] = max(slots["redundant"], int(plan.redundant.shape[-1]))
            for k, v in plan.stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
            if opt.keep_plans:
                kept.append(plan)
            history.append(plan.load)
        history = history[-max(opt.history_window, 1) :]

        times = _batch_times(priced, cost, dense_layers)
        skew[rows], t_comp[rows], t_comm[rows] = priced.skew, priced.br.t_compute, priced.br.t_comm
        t_attn[rows], t_sync[rows], dense = times.attn, times.sync, times.dense
        batch_time[b] = times.total
        slots["buffer"] = max(slots["buffer"], priced.buffer_slots)
        totals["reorder"] += priced.t_migration
        totals["redundant"] += priced.t_redundant
        totals["dense"] += dense
        totals["exposed"] += times.comm_exposed
        totals["moved"] += priced.moved
        totals["critical"] += times.critical
        totals["migration_bytes"] += priced.migration_bytes

    nb = max(counts.num_batches, 1)
    total_time = float(batch_time.sum())
    expert_bytes = cost.expert_weight_bytes()
    metrics: dict[str, float] = {
        "step_time_s": total_time / nb,
        "throughput_tokens_per_s": float(counts.tokens.sum()) / total_time if total_time > 0 else 0.0,
        "skew_mean": float(skew.mean()),
        "skew_p50": float(np.percentile(skew, 50)),
        "skew_p90": float(np.percentile(skew, 90)),
        "skew_max": float(skew.max()),
        "plan_time_s": totals["plan"] / nb,
        "replica_buffer_bytes": float(slots["buffer"] * expert_bytes),
        "reorder_moved_experts": totals["moved"] / nb,
        "migration_bytes": totals["migration_bytes"] / nb,
        "t_compute_s": float(t_comp.sum()) / nb,
        "t_comm_s": float(t_comm.sum()) / nb,
        "t_comm_exposed_s": totals["exposed"] / nb,
        "t_comm_hidden_s": (float(t_comm.sum()) - totals["exposed"]) / nb,
        "t_sync_exposed_s": (float(t_sync.sum()) + totals["redundant"]) / nb,
        "t_reorder_s": totals["reorder"] / nb,
        "t_attention_s": (float(t_attn.sum()) + totals["dense"]) / nb,
        "t_critical_path_s": totals["critical"] / nb,
        "redundant_slot_bytes": float(slots["redundant"] * counts.num_layers * expert_bytes),
    }
    for k, v in stats_sum.items():
        metrics.setdefault(k, v / nb)
    return SimResult(
        planner=str(planner.name),
        metrics=metrics,
        skew=skew,
        t_compute=t_comp,
        t_comm=t_comm,
        t_attention=t_attn,
        t_sync_exposed=t_sync,
        batch_time=batch_time,
        mb_batch=workload.mb_batch,
        plans=tuple(kept),
    )
