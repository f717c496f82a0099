"""The seams between the control plane and the planners: the batch context and the planner Protocols.

A planner is pure: it receives a :class:`BatchContext` (loads, shapes, a cost model, history) and returns a
:class:`~relibra.types.BatchPlan`. ReLibra and its ablations are compositions of a :class:`Reorderer`
(per batch and layer: placement, optionally re-assigned samples) and a :class:`Replicator` (per
micro-batch and layer: replicas in the layer-shared buffer and the token split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours
from relibra.types import BatchPlan


@dataclass(frozen=True)
class BatchContext:
    """Everything a planner may read about one batch (oracle loads: what routing replay gives)."""

    batch: int
    counts: np.ndarray
    """int32 [Sb, L, E]: per-sample expert counts of the batch's samples."""
    sample_tokens: np.ndarray
    """int64 [Sb]: tokens of each sample."""
    sample_gpu: np.ndarray
    """int32 [Sb]: default sample-to-GPU assignment (balanced by tokens)."""
    sample_mb: np.ndarray
    """int32 [Sb]: micro-batch of each sample, local to the batch (0..Mb-1)."""
    load: np.ndarray
    """int32 [Mb, L, G, E]: ``x[m, l, j, e]`` under ``sample_gpu`` / ``sample_mb``."""
    cluster: ClusterSpec
    model: ModelSpec
    cost: CostModel
    prev_home: np.ndarray | None = None
    """int32 [L, E] or None: the previous batch's placement (None for the first batch)."""
    history: tuple[np.ndarray, ...] = ()
    """Loads ``[Mb', L, G, E]`` of earlier batches, oldest first (for history-driven baselines)."""
    prev_redundant: np.ndarray | None = None
    """int32 [L, G, W] or None: the previous batch's permanent redundant copies (``BatchPlan.redundant``,
    -1 empty), so that a planner that keeps its placement between rebalances (``eplb_periodic``) keeps them
    too."""
    batches_left: int | None = None
    """Batches of the run from this one on, this one included (a trainer knows its training steps); None:
    unknown. A planner that spreads a move's migration over a placement's predicted lifetime caps the
    lifetime at it (:class:`~relibra.planners.portfolio.PortfolioPlanner`)."""
    seed: int = 0
    regroup: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False)
    """``regroup(sample_gpu) -> (load [Mb, L, G, E], tokens [Mb, G])`` for a new sample assignment."""

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @property
    def num_microbatches(self) -> int:
        return int(self.load.shape[0])


@dataclass(frozen=True)
class Reordering:
    """A reorderer's answer for one batch."""

    home: np.ndarray
    """int32 [L, E]: home GPU of each expert."""
    sample_gpu: np.ndarray
    """int32 [Sb]: sample-to-GPU assignment (the input one when no locality round ran)."""
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Replication:
    """A replicator's answer for one (micro-batch, layer) problem, or a stack of them."""

    assign: np.ndarray
    """int32 [..., E, G]: tokens of expert e computed on GPU g."""
    replicas: np.ndarray
    """int32 [..., G, r]: expert held in each replica slot (-1 empty)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Replicator-specific scalars (an exact solver's ``milp_gap``, ...); empty for the greedy."""


@dataclass(frozen=True)
class SlotBudget:
    """The expert slots a planner's plans may use beside each GPU's ``E / G`` home experts
    (docs/glossary.md, "replica slot", "redundant slot"): what the plan checker bounds, the plan dump
    records and the simulator reports."""

    replica_slots: int = 0
    """Temporary per-layer slots per GPU (ReLibra's layer-shared buffer, PopFetcher's prefetch buffer)."""
    redundant_slots: int = 0
    """Permanent extra expert slots per GPU in every layer (EPLB+, LPLB+)."""
    replicas_in_home_node: bool = True
    """Whether every extra copy stays in its expert's home node."""


@runtime_checkable
class Planner(Protocol):
    """Plans one batch. ``name`` is the result-table label (``relibra``, ``megatron``, ...);
    ``slot_budget`` the slots its plans may use."""

    @property
    def name(self) -> str: ...

    @property
    def slot_budget(self) -> SlotBudget: ...

    def plan(self, ctx: BatchContext) -> BatchPlan: ...


@runtime_checkable
class HistoryNeeds(Protocol):
    """A planner that reads earlier batches' loads (``BatchContext.history``) declares how many it needs; the
    simulator hands it exactly that many (:func:`history_need`), never a shorter window."""

    @property
    def history_batches(self) -> int:
        """Batches of past loads the planner reads (0: none)."""
        ...


def history_need(planner: object, default: int) -> int:
    """Batches of history to hand ``planner``: its declared :attr:`HistoryNeeds.history_batches` (a
    :class:`PlannerPortfolio`: the most that it or any candidate declares), or ``default`` (the run's
    ``simulator.history_window``) where nothing is declared. A wrapper that declares ``None`` (the control
    plane around a planner that declares nothing) counts as declaring nothing."""
    parts = [planner, *(planner.candidate_planners() if isinstance(planner, PlannerPortfolio) else ())]
    declared = [getattr(p, "history_batches", None) for p in parts]
    known = [int(d) for d in declared if d is not None]
    return max(known) if known else default


@runtime_checkable
class ClusterRequirements(Protocol):
    """A planner whose method cannot run on every EP group says why, before any work
    (``experiments/config/checks.py: check_config`` asks it; exit status 2 with its message)."""

    def cluster_problems(self, num_experts: int, cluster: ClusterSpec) -> list[str]:
        """Why this planner cannot plan ``num_experts`` experts on ``cluster`` (each problem names its config
        keys); empty when it can."""
        ...


class Reorderer(Protocol):
    def reorder(self, ctx: BatchContext) -> Reordering: ...


class Replicator(Protocol):
    @property
    def replica_slots(self) -> int:
        """``r``: replica slots per GPU that :meth:`replicate` may fill."""
        ...

    @property
    def refill_aware(self) -> bool:
        """Whether its copies must pay for their replica-buffer refill (:mod:`relibra.planners.refill`)."""
        ...

    def with_slots(self, replica_slots: int) -> Replicator:
        """The same replicator with ``replica_slots`` slots per GPU."""
        ...

    def replicate(
        self,
        load: np.ndarray,
        home: np.ndarray,
        ctx: BatchContext,
        overlap: OverlapNeighbours | None = None,
    ) -> Replication:
        """load [L, G, E] of one micro-batch, home [L, E] -> Replication with assign [L, E, G].

        ``overlap`` (under ``cluster.ep_overlap``, one row per layer): the micro-batch's attention and its
        neighbours' terms, so that the replicator can minimise what the micro-batch adds to the overlapped
        layer time (:mod:`relibra.planners.refill` passes it on its second pass); None: ``T_MoE``.
        """
        ...


@runtime_checkable
class StagedPlanner(Planner, Protocol):
    """A planner that is a :class:`Reorderer` (per batch) followed by a :class:`Replicator` (per
    micro-batch): the control plane runs the two stages as separate tasks."""

    @property
    def reorderer(self) -> Reorderer: ...

    @property
    def replicator(self) -> Replicator: ...


@runtime_checkable
class PlannerPortfolio(Planner, Protocol):
    """A planner that chooses among candidate planners' plans: the control plane wraps each candidate."""

    def candidate_planners(self) -> tuple[Planner, ...]:
        """The candidates, in the order ties are broken."""
        ...

    def with_candidates(self, candidates: tuple[Planner, ...]) -> PlannerPortfolio:
        """The same portfolio choosing among ``candidates`` (one per :meth:`candidate_planners` entry)."""
        ...


def home_assign(load: np.ndarray, home: np.ndarray, num_gpus: int) -> np.ndarray:
    """Every expert computed only at home. load [..., G, E], home [..., E] -> assign int32 [..., E, G]."""
    per_expert = load.sum(axis=-2)  # [..., E]
    onehot = np.arange(num_gpus) == home[..., None]  # [..., E, G]
    return (per_expert[..., None] * onehot).astype(np.int32)


def static_placement(num_layers: int, num_experts: int, num_gpus: int) -> np.ndarray:
    """Megatron-LM's contiguous placement: expert ``e`` on GPU ``e // (E / G)``. -> int32 [L, E]."""
    per_gpu = num_experts // num_gpus
    return np.broadcast_to(np.arange(num_experts) // per_gpu, (num_layers, num_experts)).astype(np.int32)


def previous_home(ctx: BatchContext) -> np.ndarray:
    """int32 [L, E]: the placement the batch starts from: ``ctx.prev_home``, or Megatron-LM's static one on
    the first batch (where the simulator charges migration from)."""
    if ctx.prev_home is not None:
        return np.asarray(ctx.prev_home, dtype=np.int32)
    _, num_layers, _, num_experts = np.shape(ctx.load)
    return static_placement(num_layers, num_experts, ctx.num_gpus)


def reordered_load(ctx: BatchContext, sample_gpu: np.ndarray, planner: str) -> np.ndarray:
    """The loads [Mb, L, G, E] under a reordering's sample_gpu [Sb]: ``ctx.load`` when no sample moved,
    else ``ctx.regroup(sample_gpu)``'s load. ``planner`` names the caller in the error raised when samples
    moved but ``ctx.regroup`` is None."""
    if np.array_equal(sample_gpu, ctx.sample_gpu):
        return np.asarray(ctx.load)
    if ctx.regroup is None:
        raise ValueError(
            f"planner {planner!r}: the reorderer moved samples but ctx.regroup is None; the "
            "control plane must provide regroup(sample_gpu) -> (load, tokens)"
        )
    return np.asarray(ctx.regroup(sample_gpu)[0])


@runtime_checkable
class StagedReorderer(Protocol):
    """A reorderer whose per-layer round and whole-batch locality round can run as separate tasks.

    ``reorder(ctx)`` must equal ``place(ctx)`` followed, when ``moves_samples``, by
    ``locality_step(ctx, home)`` (:class:`~relibra.planners.reorder.anneal.AnnealingReorderer` is one).
    """

    @property
    def moves_samples(self) -> bool:
        """Whether the locality round runs (it may move samples between GPUs)."""
        ...

    def reorder(self, ctx: BatchContext) -> Reordering: ...

    def place(self, ctx: BatchContext, layers: Any = None) -> Reordering:
        """Placement of ctx's layers (``layers``: their batch-wide indices); samples stay put."""
        ...

    def locality_step(self, ctx: BatchContext, home: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """Whole batch, placement ``home`` [L, E] -> (``sample_gpu`` int32 [Sb], stats)."""
        ...
