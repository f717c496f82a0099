"""ReLibra's planners: a Reorderer (per batch) composed with a Replicator (per micro-batch and layer).

* ``relibra``: simulated-annealing reordering (:class:`relibra.planners.reorder.anneal.AnnealingReorderer`),
then
  the incremental greedy replication (:class:`relibra.planners.replicate.greedy.GreedyReplicator`);
* ``relibra_replicate_only``: Megatron-LM's static placement, then the greedy replication;
* ``relibra_keep_placement``: the previous batch's placement, then the greedy replication (no migration;
  ``relibra_replicate_only(placement="previous")``);
* ``relibra_milp``: static placement (or any reorderer), then the exact MILP per problem
  (:class:`relibra.planners.replicate.milp.MilpReplicator`), a reference for small and medium instances.

:class:`ComposedPlanner` is the generic composition; the three names are factory functions over it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from relibra.planners.protocols import (
    BatchContext,
    Reorderer,
    Reordering,
    Replicator,
    SlotBudget,
    previous_home,
    reordered_load,
    static_placement,
)
from relibra.planners.refill import replicate_batch
from relibra.planners.reorder.anneal import AnnealingReorderer
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyConfig, GreedyReplicator
from relibra.planners.replicate.milp import MajorizeConfig, MilpConfig, MilpReplicator
from relibra.relabel import relabel_for
from relibra.types import BatchPlan

__all__ = [
    "ComposedPlanner",
    "PreviousReorderer",
    "StaticReorderer",
    "composed",
    "relibra",
    "relibra_milp",
    "relibra_replicate_only",
]


@dataclass(frozen=True)
class StaticReorderer:
    """Megatron-LM's contiguous placement, samples where the context put them (no reordering)."""

    def reorder(self, ctx: BatchContext) -> Reordering:
        _, num_layers, g, num_experts = np.shape(ctx.load)
        home = static_placement(num_layers, num_experts, g)
        return Reordering(home=home, sample_gpu=np.asarray(ctx.sample_gpu, dtype=np.int32))


@dataclass(frozen=True)
class PreviousReorderer:
    """The previous batch's placement (Megatron-LM's static one on the first batch), samples where the
    context put them: no reordering, so nothing migrates."""

    def reorder(self, ctx: BatchContext) -> Reordering:
        if ctx.prev_home is None:
            return StaticReorderer().reorder(ctx)
        _, num_layers, _, num_experts = np.shape(ctx.load)
        home = np.array(ctx.prev_home, dtype=np.int32)
        if home.shape != (num_layers, num_experts):
            raise ValueError(
                f"ctx.prev_home has shape {home.shape}; expected [L, E]=({num_layers}, {num_experts})"
            )
        return Reordering(home=home, sample_gpu=np.asarray(ctx.sample_gpu, dtype=np.int32))


@dataclass(frozen=True)
class ComposedPlanner:
    """``reorderer`` once per batch, then ``replicator`` for every micro-batch (all its layers at once).

    Replication pays for its replica-buffer refill (:func:`relibra.planners.refill.replicate_within_window`).
    The plan is then relabelled to keep experts where they were (:func:`relibra.relabel.relabel_for`), and
    its ``reorder_moved_experts`` / ``reorder_kept_layers`` stats count the relabelled plan's moves from the
    placement in force.
    ``plan_time_s`` covers both stages; ``stats`` merges the reorderer's and the replicators' (the latter
    averaged over micro-batches) with ``replicate_time_s`` and ``replicas_mean`` (filled slots per
    (micro-batch, layer) and GPU).
    """

    name: str
    reorderer: Reorderer
    replicator: Replicator
    replica_slots: int

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(replica_slots=self.replica_slots)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        t0 = time.perf_counter()
        reo = self.reorderer.reorder(ctx)
        sample_gpu = np.asarray(reo.sample_gpu, dtype=np.int32)
        load = reordered_load(ctx, sample_gpu, self.name)
        home = np.asarray(reo.home, dtype=np.int32)
        t1 = time.perf_counter()
        reps = replicate_batch(self.replicator, load, home, ctx, sample_gpu)
        t2 = time.perf_counter()
        _, num_layers, g, num_experts = load.shape
        if reps:
            assign = np.stack([r.assign for r in reps]).astype(np.int32)
            replicas = np.stack([r.replicas for r in reps]).astype(np.int32)
        else:
            assign = np.zeros((0, num_layers, num_experts, g), dtype=np.int32)
            replicas = np.zeros((0, num_layers, g, self.replica_slots), dtype=np.int32)
        stats: dict[str, float] = dict(reo.stats)
        for key in sorted({k for r in reps for k in r.stats}):
            stats[key] = float(np.mean([r.stats[key] for r in reps if key in r.stats]))
        stats["replicate_time_s"] = t2 - t1
        stats["replicas_mean"] = float((replicas >= 0).sum(axis=-1).mean()) if replicas.size else 0.0
        plan = BatchPlan(
            home=home,
            assign=assign,
            load=np.asarray(load, dtype=np.int32),
            sample_gpu=sample_gpu,
            replicas=replicas,
            stats=stats,
        )
        # NOTE: the annealer re-plans from scratch; among equivalent relabellings keep experts in place.
        plan = relabel_for(plan, ctx)
        prev = previous_home(ctx)
        stats = dict(plan.stats)
        stats["reorder_moved_experts"] = float(np.count_nonzero(plan.home != prev))
        stats["reorder_kept_layers"] = float(np.count_nonzero((plan.home == prev).all(axis=1)))
        return replace(plan, stats=stats, plan_time_s=time.perf_counter() - t0)


def composed(name: str, reorderer: Reorderer, replicator: Replicator) -> ComposedPlanner:
    """``reorderer`` then ``replicator``, with the replicator's ``replica_slots`` (declared there only)."""
    return ComposedPlanner(name, reorderer, replicator, replica_slots=replicator.replica_slots)


def relibra(
    replica_slots: int,
    reorder: AnnealConfig | None = None,
    replicate: GreedyConfig | None = None,
    name: str = "relibra",
) -> ComposedPlanner:
    """ReLibra: annealing reordering (``reorder``: its :class:`AnnealConfig`), then greedy replication into
    ``replica_slots`` slots per GPU (``replicate``: its :class:`GreedyConfig`; by default copies must pay for
    their buffer refill, :mod:`relibra.planners.refill`)."""
    return composed(name, AnnealingReorderer(reorder), _greedy(replica_slots, replicate))


def relibra_replicate_only(
    replica_slots: int,
    replicate: GreedyConfig | None = None,
    name: str = "relibra_replicate_only",
    placement: str = "static",
) -> ComposedPlanner:
    """Greedy replication on a placement that is not reordered: ``placement="static"``, Megatron-LM's (the
    ablation ``relibra_replicate_only``), or ``"previous"``, the previous batch's (``relibra_keep_placement``:
    nothing migrates; the portfolio's candidate for batches whose reordering would not repay it)."""
    reorderers: dict[str, Reorderer] = {"static": StaticReorderer(), "previous": PreviousReorderer()}
    if placement not in reorderers:
        raise ValueError(f"{name}: placement={placement!r}; expected one of {sorted(reorderers)}")
    return composed(name, reorderers[placement], _greedy(replica_slots, replicate))


def relibra_milp(
    replica_slots: int,
    replicate: MilpConfig | None = None,
    reorderer: Reorderer | None = None,
    name: str = "relibra_milp",
    majorize: MajorizeConfig | None = None,
) -> ComposedPlanner:
    """Reference: ``reorderer`` (static placement by default), then the exact MILP for every problem
    (``replicate``: its :class:`MilpConfig`; ``majorize``: its loop under ``cluster.dispatcher=deepep``,
    None: :class:`MajorizeConfig`'s defaults)."""
    milp = MilpReplicator(
        replica_slots,
        replicate if replicate is not None else MilpConfig(),
        majorize if majorize is not None else MajorizeConfig(),
    )
    return composed(name, reorderer if reorderer is not None else StaticReorderer(), milp)


def _greedy(replica_slots: int, config: GreedyConfig | None) -> GreedyReplicator:
    return GreedyReplicator(replica_slots, config if config is not None else GreedyConfig())
