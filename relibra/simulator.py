"""The simulated executor: runs a planner batch by batch over a workload and prices every plan.

For each batch ``b`` the simulator builds a :class:`~relibra.planners.protocols.BatchContext` (oracle loads,
the previous placement, recent history, a ``regroup`` closure; :func:`relibra.workload.batch_context`), calls
the planner, times it, and prices the plan with :mod:`relibra.cost.pricing` (the one place plans are
priced, with the :class:`~relibra.cost.model.CostModel`):

* per (micro-batch, layer): ``T_MoE = max_g T_comp + max_g T_comm`` (:meth:`CostModel.moe`), attention
  ``max_g T_attn(g)``, and the exposed replica-buffer refill ``max(0, refill - attn_fwd) +
  max(0, refill - attn_bwd)`` (forward fill, backward gradient reduction, each hidden behind the layer's
  attention of that pass); for an online planner's plan (``BatchPlan.online``: UltraEP, LLEP) its
  planning time on the critical path (``t_critical_path_s``) and its weight copies, priced on the fabric
  and charged as :class:`~relibra.types.OnlineCopies` says (after routing, not behind attention);
* per batch: dense (non-MoE) layers, reordering migration of every expert whose home changed (weights,
  and optimizer state, :class:`~relibra.cost.migration.MigrationPayload`), and the gradient reduction plus
  weight broadcast of permanent redundant copies (EPLB+, LPLB+).

Every weight transfer above is one entry of the plan's transfer schedule, priced by one function
(:mod:`relibra.cost.transfers`); the result columns are the fields of
:class:`~relibra.breakdown.StepBreakdown`.

A batch is one RL training step: ``step_time_s`` is the mean batch time and throughput is all tokens over
all batch time. An ideal :class:`Bound` (Balanced) has no plan: it prices each (micro-batch, layer)
directly and its skewness is 1 by definition.

With ``trained`` routes (:class:`~relibra.trained_routes.TrainedRoutes`: routing replay off or partial,
:mod:`relibra.trace.mismatch`) a planner plans on the replayed routes and its plan is priced as the training
step runs it on the trained ones (:func:`~relibra.trained_routes.run_on_trained`) when it plans from routing
replay (its registry card says so); every other planner, the bound and every history get the trained routes
(:mod:`relibra.trained_routes` says which planner receives what). Without them the two are one and the same:
the loads a planner sees are the loads it is priced on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol, runtime_checkable

import numpy as np
import pandas as pd

from relibra.breakdown import METRIC_COLUMNS, WHOLE_STEP_COLUMNS, StepBreakdown
from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel, MoEBreakdown
from relibra.cost.pricing import Priced, batch_times, cast_seconds, permute_seconds, price_plan
from relibra.cost.transfers import TransferSchedule
from relibra.cost.work import LayerWork
from relibra.executors.protocol import ExecutionReport
from relibra.invariants import check_plan
from relibra.planners.protocols import BatchContext, Planner, SlotBudget, history_need, static_placement
from relibra.trained_routes import TrainedRoutes, plans_on_replay, run_on_trained
from relibra.types import BatchPlan, SampleCounts, Workload
from relibra.workload import batch_context

__all__ = [
    "METRIC_COLUMNS",
    "WHOLE_STEP_COLUMNS",
    "Bound",
    "CostModelExecutor",
    "SimOptions",
    "SimResult",
    "batch_context",
    "simulate",
]


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

    history_window: int = 4
    """Batches of past loads handed in ``BatchContext.history`` to a planner that declares no window of its
    own; one that declares (:class:`~relibra.planners.protocols.HistoryNeeds`) gets exactly its window."""
    keep_plans: bool = False
    seed: int = 0
    check_plans: bool = False
    """Run :func:`~relibra.invariants.check_plan` on every plan, within the planner's ``slot_budget``."""


@dataclass(frozen=True)
class SimResult:
    """What one planner run over a workload produced."""

    planner: str
    metrics: dict[str, float]
    """The result columns (:data:`METRIC_COLUMNS`, docs/spine.md) plus planner stats (means over batches)."""
    breakdown: StepBreakdown
    """The result columns alone, typed (``metrics`` holds them first, then the planner stats)."""
    skew: np.ndarray
    """float64 [M, L]: skewness of each (micro-batch, layer)."""
    t_compute: np.ndarray
    """float64 [M, L]: ``max_g T_comp`` seconds."""
    t_comm: np.ndarray
    """float64 [M, L]: ``max_g T_comm`` seconds."""
    t_layer_attention: np.ndarray
    """float64 [M, L]: one MoE layer's attention seconds (fwd + bwd) on the busiest GPU of each micro-batch;
    not the ``t_attention_s`` column, which sums these over every (micro-batch, layer) and adds the dense
    layers, per step."""
    t_sync_exposed: np.ndarray
    """float64 [M, L]: exposed replica-refill seconds."""
    batch_time: np.ndarray
    """float64 [B]: seconds of each batch (step)."""
    mb_batch: np.ndarray
    """int32 [M]: batch of each micro-batch."""
    moved: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """int64 [B]: (layer, expert) pairs whose home changed in each batch."""
    migration_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """float64 [B]: bytes sent between GPUs to re-home them in each batch."""
    kept: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=bool))
    """bool [B, L]: whether each layer kept its placement in each batch (a bound moves nothing)."""
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
                "t_layer_attention_s": self.t_layer_attention.ravel(),
                "t_sync_exposed_s": self.t_sync_exposed.ravel(),
            }
        )


class CostModelExecutor:
    """The cost model behind the :class:`~relibra.executors.protocol.Executor` seam (``executor=sim``)."""

    name = "sim"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def execute(self, plans: Sequence[BatchPlan], model: ModelSpec, cluster: ClusterSpec) -> ExecutionReport:
        times = [self.cost.moe(p.load, p.assign).t_moe for p in plans]
        return ExecutionReport(moe_time_s=np.concatenate(times, axis=0))


def _price_bound(bound: Bound, ctx: BatchContext, workload: Workload, rows: slice, cost: CostModel) -> Priced:
    br = bound.bound(ctx)
    g = workload.tokens.shape[1]
    # NOTE: an ideal has attention and dense layers at their mean over GPUs too: each GPU holds the mean
    # tokens and causal pairs of its micro-batch (both times are linear in them), whatever the layout; and
    # every GPU receives the mean of the expert slots (permutation is linear in them).
    tokens = np.repeat(workload.tokens[rows].mean(axis=1, keepdims=True), g, axis=1)
    pairs = np.repeat(workload.causal_pairs[rows].mean(axis=1, keepdims=True), g, axis=1)
    received = np.asarray(ctx.load, dtype=np.float64).sum(axis=(-2, -1))[..., None] / g  # [Mb, L, 1]
    permute = permute_seconds(cost, received)
    cast = cast_seconds(cost, received)
    training = cost.training
    reference = None
    if training is not None and "reference" in training.rl_passes:
        zero = np.zeros(br.t_compute.shape)
        reference = LayerWork(br.t_compute, br.t_comm, zero if permute is None else permute, cast=cast)
    return Priced(
        br=br,
        skew=np.ones(br.t_compute.shape),
        tokens=tokens,
        pairs=pairs,
        transfers=TransferSchedule(layer_shape=(int(br.t_compute.shape[0]), int(br.t_compute.shape[1]))),
        permute=permute,
        cast=cast,
        reference=reference,
    )


def simulate(
    planner: Planner | Bound,
    counts: SampleCounts,
    workload: Workload,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    options: SimOptions | None = None,
    trained: TrainedRoutes | None = None,
) -> SimResult:
    """Run ``planner`` over every batch of ``workload`` and price it.

    Args:
        planner: a :class:`~relibra.planners.protocols.Planner` (returns plans) or a :class:`Bound`
        (Balanced). counts: per-sample counts [S, L, E] behind ``workload``; workload: loads [M, L, G, E] and
        layout. cluster, model, cost: the EP group, the model shape and the cost model that prices plans.
        trained: the routes the training step takes where they differ from ``counts`` (module doc); None:
        exact replay.
    Returns:
        :class:`SimResult` with the result columns and per-(micro-batch, layer) arrays [M, L].
    """
    opt = options or SimOptions()
    shape = (workload.num_microbatches, counts.num_layers)
    skew, t_comp, t_comm, t_attn, t_sync = (np.zeros(shape) for _ in range(5))
    batch_time = np.zeros(counts.num_batches)
    moved = np.zeros(counts.num_batches, dtype=np.int64)
    moved_bytes = np.zeros(counts.num_batches)
    kept = np.ones((counts.num_batches, counts.num_layers), dtype=bool)
    totals = dict.fromkeys(("reorder", "hidden", "redundant", "dense", "plan", "critical", "exposed"), 0.0)
    budget = planner.slot_budget
    slots = {"buffer": budget.replica_slots, "redundant": 0}
    stats_sum: dict[str, float] = {}
    kept_plans: list[BatchPlan] = []
    parts = dict.fromkeys(WHOLE_STEP_COLUMNS, 0.0)
    history: list[np.ndarray] = []
    # NOTE: the model starts in Megatron's placement, so moving away from it in batch 0 is charged too.
    prev_home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    planner_prev: np.ndarray | None = None
    prev_redundant: np.ndarray | None = None
    dense_layers = model.num_layers - model.num_moe_layers
    need = history_need(planner, opt.history_window)
    if trained is not None:
        trained.check(counts, workload)
    replayed = trained is not None and isinstance(planner, Planner) and plans_on_replay(str(planner.name))

    for b in range(counts.num_batches):
        window = tuple(history[-need:]) if need else ()

        context = partial(
            batch_context,
            batch=b,
            cluster=cluster,
            model=model,
            cost=cost,
            prev_home=planner_prev,
            history=window,
            seed=opt.seed,
            prev_redundant=prev_redundant,
        )
        truth = ctx = replace(context(counts, workload), batches_left=counts.num_batches - b)
        if trained is not None:  # the replayed routes for the planner, the trained ones for the step
            truth = replace(context(trained.counts, trained.workload), batches_left=ctx.batches_left)
            ctx = ctx if replayed else truth
        mbs = workload.batch_microbatches(b)
        rows = slice(int(mbs[0]), int(mbs[-1]) + 1)
        t0 = time.perf_counter()
        if isinstance(planner, Bound) and not isinstance(planner, Planner):
            priced = _price_bound(planner, truth, workload, rows, cost)
            totals["plan"] += time.perf_counter() - t0
            history.append(truth.load)
        else:
            plan = planner.plan(ctx)  # type: ignore[union-attr]
            elapsed = time.perf_counter() - t0
            totals["plan"] += plan.plan_time_s if plan.plan_time_s > 0 else elapsed
            run = plan
            if truth is not ctx:
                if plan.online is not None:
                    raise ValueError(
                        f"planner {planner.name!r} made an online plan (after the step's routing) but its "
                        "registry card says it plans from routing replay, so it saw the replayed routes"
                    )
                run = run_on_trained(plan, truth)
            if opt.check_plans:  # the plan as made, and as the step runs it on the trained routes
                for checked, on in [(plan, ctx)] + ([] if run is plan else [(run, truth)]):
                    check_plan(
                        checked,
                        on,
                        replica_slots=budget.replica_slots,
                        redundant_slots=budget.redundant_slots,
                        replicas_in_home_node=budget.replicas_in_home_node,
                    )
            priced = price_plan(run, truth, cost, prev_home)
            kept[b] = (np.asarray(plan.home) == prev_home).all(axis=1)
            prev_home = planner_prev = plan.home
            prev_redundant = plan.redundant
            if plan.redundant is not None:
                slots["redundant"] = max(slots["redundant"], int(plan.redundant.shape[-1]))
            for k, v in plan.stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
            if opt.keep_plans:
                kept_plans.append(plan)
            history.append(run.load)
        history = history[-max(need, 1) :]

        times = batch_times(priced, cost, dense_layers)
        skew[rows], t_comp[rows], t_comm[rows] = priced.skew, priced.br.t_compute, priced.br.t_comm
        t_attn[rows], t_sync[rows], dense = times.attn, times.sync, times.dense
        batch_time[b] = times.total
        charge = times.transfers
        slots["buffer"] = max(slots["buffer"], priced.transfers.buffer_slots)
        totals["reorder"] += charge.step_exposed("migration")
        totals["hidden"] += charge.hidden.get("migration", 0.0)
        totals["redundant"] += charge.step_exposed("redundant_sync")
        totals["dense"] += dense
        totals["exposed"] += times.comm_exposed
        moved[b], moved_bytes[b] = priced.transfers.moved, charge.network_bytes.get("migration", 0.0)
        totals["critical"] += times.critical
        for k in parts:
            parts[k] += times.parts[k]

    nb = max(counts.num_batches, 1)
    total_time = float(batch_time.sum())
    expert_bytes = cost.expert_weight_bytes()
    breakdown = StepBreakdown(
        step_time_s=total_time / nb,
        throughput_tokens_per_s=float(counts.tokens.sum()) / total_time if total_time > 0 else 0.0,
        skew_mean=float(skew.mean()),
        skew_p50=float(np.percentile(skew, 50)),
        skew_p90=float(np.percentile(skew, 90)),
        skew_max=float(skew.max()),
        plan_time_s=totals["plan"] / nb,
        replica_buffer_bytes=float(slots["buffer"] * expert_bytes),
        reorder_moved_experts=float(moved.sum()) / nb,
        migration_bytes=float(moved_bytes.sum()) / nb,
        layers_kept_share=float(kept.mean()) if kept.size else 1.0,
        layers_kept_share_min=float(kept.mean(axis=0).min()) if kept.size else 1.0,
        t_compute_s=float(t_comp.sum()) / nb,
        t_comm_s=float(t_comm.sum()) / nb,
        t_comm_exposed_s=totals["exposed"] / nb,
        t_comm_hidden_s=(float(t_comm.sum()) - totals["exposed"]) / nb,
        t_sync_exposed_s=(float(t_sync.sum()) + totals["redundant"]) / nb,
        t_reorder_s=totals["reorder"] / nb,
        t_reorder_hidden_s=totals["hidden"] / nb,
        t_attention_s=(float(t_attn.sum()) + totals["dense"]) / nb,
        t_critical_path_s=totals["critical"] / nb,
        redundant_slot_bytes=float(slots["redundant"] * counts.num_layers * expert_bytes),
        **{k: v / nb for k, v in parts.items()},
    )
    metrics = breakdown.columns()
    for k, v in stats_sum.items():
        metrics.setdefault(k, v / nb)
    return SimResult(
        planner=str(planner.name),
        metrics=metrics,
        breakdown=breakdown,
        skew=skew,
        t_compute=t_comp,
        t_comm=t_comm,
        t_layer_attention=t_attn,
        t_sync_exposed=t_sync,
        batch_time=batch_time,
        mb_batch=workload.mb_batch,
        moved=moved,
        migration_bytes=moved_bytes,
        kept=kept,
        plans=tuple(kept_plans),
    )
