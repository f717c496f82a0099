"""The control plane: plans each batch in worker processes while the trainer does post-rollout processing.

The trainer's calls (DESIGN.md, "Pipeline")::

    cp = ControlPlane.from_planner(relibra(replica_slots=2), cluster, model, cost,
                                   ControlPlaneConfig(workers=8, samples_per_microbatch=1))
    for step in training:
        for chunk in rollout():              # samples come back in any order, in any chunks
            cp.submit(chunk)                 # per-sample counts, a RoutingTrace, or (counts, tokens)
        batch = cp.seal()                    # the batch is complete: planning starts now
        ...rewards, reference / old-policy log-probabilities...
        plan = cp.plans(batch, deadline_s=0.0)   # never blocks past the deadline
        report = cp.report(batch)            # per-layer status, time to first plan, fallbacks
        train(plan)
    cp.close()

Stages of one batch, after :meth:`ControlPlane.seal`:

1. **Workload assembly** (coordinator thread): samples sorted by their id (so arrival order never changes a
   plan), laid out over GPUs and micro-batches (:func:`relibra.workload.layout_samples`), loads
   ``x[m, l, j, e]`` (:func:`relibra.workload.microbatch_loads`).
2. **Placement per layer**: one task per MoE layer runs the planner's reorderer on a one-layer
   :class:`~relibra.planners.protocols.BatchContext` (layers are independent in this round). A
   :class:`StagedReorderer` (ReLibra's :class:`~relibra.planners.reorder.anneal.AnnealingReorderer`) runs only
   its per-layer round there (``place``), seeded by the batch and the layer's batch-wide index, so each
   layer gets exactly the row that the serial planner computes.
3. **Locality round** (only when the reorderer ``moves_samples``; ReLibra's second round): once every
   layer's placement is in (or fell back), one whole-batch task re-assigns samples to GPUs under that
   placement (``locality_step``) and returns the loads regrouped under the new ``sample_gpu``.
4. **Replication per layer**: one task per layer runs the :class:`~relibra.planners.protocols.Replicator` on
   every micro-batch of that layer, on the (regrouped) loads. Without a locality round a layer's replication
   starts as soon as its placement is in.

Tasks run in a pool of ``workers`` single-process executors (``concurrent.futures.ProcessPoolExecutor``),
lower layers first, each layer's replication before the next layer's reordering, so plans become ready
layer by layer. A planner that is not a reorderer/replicator composition (the baselines) runs as one
whole-batch task. With the same seeds the delivered plan equals the serial planner's
(:class:`~relibra.planners.compose.ComposedPlanner`) exactly, for any worker count.

**Deadline and fallbacks.** :meth:`ControlPlane.plans` waits at most ``deadline_s``; then a layer whose
reordering is not ready keeps the *previous placement* (the last delivered batch's, Megatron's static one
at first), a layer whose replication is not ready gets *no replication* (every expert computed at home).
Each fallback is recorded per layer in :class:`PlanReport`. The locality round has its own limit,
``locality_deadline_s`` from its start (its worker is replaced when it runs over); a locality round that
runs over, fails, or is not ready at the deadline leaves every sample on its input GPU
(:attr:`PlanReport.locality`), and replication runs on the input loads. A task that raises falls back at
once (it would raise again); a task whose worker process dies is re-run on a fresh worker up to
``max_retries`` times, then falls back. Since every worker runs one task at a time, a crash is blamed on
exactly one task; no layer is ever lost: every delivered plan covers every layer.

Timing (seconds, in :class:`PlanReport` and ``BatchPlan.stats``): measured from the last sample's
arrival (the last :meth:`submit` before :meth:`seal`): ``time_to_first_plan_s`` (one layer fully
planned), ``time_to_all_plans_s`` (every layer planned or failed), ``plan_cpu_s`` (sum of task times in
workers). ``BatchPlan.plan_time_s`` is ``time_to_all_plans_s`` (or the delivery time when the deadline
cut planning short).
"""

from __future__ import annotations

import heapq
import itertools
import math
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from enum import IntFlag, StrEnum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import (
    BatchContext,
    Planner,
    Reorderer,
    Reordering,
    Replicator,
    SlotBudget,
    StagedPlanner,
    home_assign,
    static_placement,
)
from relibra.planners.refill import replicate_batch
from relibra.relabel import relabel_plan
from relibra.trace.format import RoutingTrace
from relibra.types import BatchPlan, SampleCounts
from relibra.workload import (
    LAYOUTS,
    SampleLayout,
    layout_samples,
    microbatch_loads,
    sample_context,
)

__all__ = [
    "ControlPlane",
    "ControlPlaneConfig",
    "Fallback",
    "LocalityStatus",
    "PlanReport",
    "StagedReorderer",
]


class Fallback(IntFlag):
    """Per-layer fallback flags of a delivered plan (0: fully planned)."""

    NONE = 0
    PREVIOUS_PLACEMENT = 1
    """Reordering not ready or failed: the layer keeps the previous batch's placement."""
    NO_REPLICATION = 2
    """Replication not ready or failed: every expert of the layer is computed at home."""


class LocalityStatus(StrEnum):
    """What became of a batch's locality round (the sample re-assignment after placement)."""

    OFF = "off"
    """The reorderer has no locality round: samples stay on their input GPUs by design."""
    DONE = "done"
    """The round ran: samples are on the GPUs it chose, loads regrouped accordingly."""
    TIMED_OUT = "timed_out"
    """Fallback: the round ran past ``locality_deadline_s``; samples keep their input GPUs."""
    FAILED = "failed"
    """Fallback: the round raised, or its worker died ``max_retries + 1`` times; input GPUs kept."""
    NOT_READY = "not_ready"
    """Fallback: :meth:`ControlPlane.plans`'s deadline came first; input GPUs kept."""


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


@dataclass(frozen=True)
class ControlPlaneConfig:
    """How the control plane assembles workloads and runs its workers."""

    workers: int = 2
    """Worker processes; 0 plans inline in the coordinator thread (no processes; for debugging)."""
    samples_per_microbatch: int | None = None
    """``K`` samples per GPU per micro-batch (see :func:`relibra.workload.split_microbatches`)."""
    tokens_per_microbatch: int | None = None
    """Or a per-GPU token budget per micro-batch (at most one of the two)."""
    layout: str = LAYOUTS[0]
    """The sample layout (:data:`relibra.workload.LAYOUTS`: ``balanced`` or ``contiguous``)."""
    max_retries: int = 1
    """Re-runs of a task whose worker process died, before its layer falls back."""
    deadline_s: float | None = None
    """Default wait of :meth:`ControlPlane.plans` and :meth:`ControlPlane.plan` (None: until all ready)."""
    mp_context: str = "spawn"
    """Start method of worker processes. NOTE: ``spawn`` because a trainer process holds CUDA state and
    threads, which ``fork`` does not copy safely."""
    seed: int = 0
    """Base seed of batches given through :meth:`ControlPlane.seal`: batch ``b`` plans with seed
    ``seed + b`` (as :func:`relibra.simulator.batch_context` does); :meth:`ControlPlane.plan` uses the
    context's own seed."""
    locality_deadline_s: float | None = None
    """Seconds the locality round may run once a worker started it (None: no own limit); past it, samples
    keep their input GPUs (:attr:`LocalityStatus.TIMED_OUT`)."""
    warm_up: bool = True
    """Plan one small random layer in each worker at start-up (process start, imports, loading the numba
    kernels from their on-disk cache, or compiling them when it is cold)."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers={self.workers}; expected >= 0 (0 plans inline)")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}; expected >= 0")
        if self.samples_per_microbatch is not None and self.tokens_per_microbatch is not None:
            raise ValueError("give samples_per_microbatch or tokens_per_microbatch, not both")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ValueError(f"deadline_s={self.deadline_s}; expected >= 0 or None")
        if self.locality_deadline_s is not None and self.locality_deadline_s < 0:
            raise ValueError(f"locality_deadline_s={self.locality_deadline_s}; expected >= 0 or None")


@dataclass(frozen=True)
class PlanReport:
    """What happened while one batch was planned."""

    batch: int
    fallback: np.ndarray
    """int8 [L]: :class:`Fallback` flags of each layer in the delivered plan."""
    layer_ready_s: np.ndarray
    """float64 [L]: seconds from the last arrival until the layer was fully planned (NaN: it was not)."""
    time_to_first_plan_s: float
    """Seconds from the last arrival until the first layer was fully planned (NaN: none was)."""
    time_to_all_plans_s: float
    """Seconds from the last arrival until every layer was planned or failed (NaN: cut by the deadline)."""
    assemble_s: float
    """Seconds spent on workload assembly."""
    plan_cpu_s: float
    """Sum of the finished tasks' run times in the workers."""
    wait_s: float
    """Seconds :meth:`ControlPlane.plans` blocked the trainer."""
    retries: int
    """Tasks re-run after their worker died."""
    worker_crashes: int
    """Worker processes that died while running one of this batch's tasks."""
    errors: tuple[str, ...] = ()
    """One line per failed task: ``layer L reorder: ...`` (``batch locality: ...`` for the locality round)."""
    locality: LocalityStatus = LocalityStatus.OFF
    """What became of the locality round (its fallback: every sample on its input GPU)."""
    locality_s: float = math.nan
    """Seconds the locality round ran in its worker (NaN: it did not finish)."""

    @property
    def locality_fallback(self) -> bool:
        """The plan keeps the input sample assignment although a locality round was due."""
        return self.locality in (LocalityStatus.TIMED_OUT, LocalityStatus.FAILED, LocalityStatus.NOT_READY)

    @property
    def previous_placement_layers(self) -> int:
        return int(np.count_nonzero(self.fallback & Fallback.PREVIOUS_PLACEMENT))

    @property
    def no_replication_layers(self) -> int:
        return int(np.count_nonzero(self.fallback & Fallback.NO_REPLICATION))


# ------------------------------------------------------------------------------------ worker side
@dataclass(frozen=True)
class _Kit:
    """What every task needs besides its arrays; sent once to each worker by its initializer."""

    cluster: ClusterSpec
    model: ModelSpec
    cost: CostModel
    reorderer: Reorderer | None
    replicator: Replicator | None
    planner: Planner | None
    replica_slots: int

    @property
    def staged(self) -> bool:
        """The reorderer's per-layer round runs alone in the layer tasks (:class:`StagedReorderer`)."""
        return isinstance(self.reorderer, StagedReorderer)

    @property
    def locality(self) -> bool:
        """A whole-batch locality round runs between placement and replication."""
        return isinstance(self.reorderer, StagedReorderer) and bool(self.reorderer.moves_samples)


_WORKER_KIT: _Kit | None = None
"""The worker process's kit. NOTE: process-global by necessity (a ProcessPoolExecutor initializer's only
way to hand state to later tasks); the coordinator process never sets it."""


def _init_worker(kit: _Kit) -> None:
    global _WORKER_KIT
    _WORKER_KIT = kit


def _warm(kit: _Kit | None = None) -> float:
    """Plan one small random layer (and its locality round) once per worker at start-up, so that process
    start, imports and loading (or compiling) the numba kernels are off the critical path. Returns its
    seconds. Compilation itself is cached on disk: see :mod:`relibra.planners.warmup`."""
    t0 = time.perf_counter()
    kit = kit or _kit()
    g, num_experts = kit.cluster.num_gpus, kit.model.num_experts
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 8, size=(g, 1, num_experts)).astype(np.int32)
    sample_gpu = np.arange(g, dtype=np.int32)
    part = _Slice(
        batch=0,
        counts=counts,
        sample_tokens=np.full(g, 8, dtype=np.int64),
        sample_gpu=sample_gpu,
        sample_mb=np.zeros(g, dtype=np.int32),
        load=microbatch_loads(counts, sample_gpu, np.zeros(g, dtype=np.int32), 1, g),
        prev_home=static_placement(1, num_experts, g),
        seed=0,
    )
    if kit.reorderer is not None:
        home, _, _ = _reorder_task(part, kit)
        part = replace(part, home=home[None])
        if kit.locality:
            _locality_task(part, kit)
        _replicate_task(part, kit)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class _Slice:
    """The arrays of one batch a task needs (one layer, or every layer for a whole-batch planner)."""

    batch: int
    counts: np.ndarray
    """int32 [Sb, L', E]."""
    sample_tokens: np.ndarray
    """int64 [Sb]."""
    sample_gpu: np.ndarray
    """int32 [Sb]."""
    sample_mb: np.ndarray
    """int32 [Sb] local micro-batch."""
    load: np.ndarray
    """int32 [Mb, L', G, E]."""
    prev_home: np.ndarray | None
    """int32 [L', E] or None."""
    seed: int
    layer: int = 0
    """Batch-wide index of the slice's first layer."""
    home: np.ndarray | None = None
    """int32 [L', E]: the placement to replicate on (replication tasks), or to re-assign samples under (the
    locality round)."""
    history: tuple[np.ndarray, ...] = ()
    """Loads [Mb', L, G, E] of earlier batches (whole-batch planners that use history)."""


def _context(kit: _Kit, part: _Slice) -> BatchContext:
    return sample_context(
        batch=part.batch,
        counts=part.counts,
        sample_tokens=part.sample_tokens,
        sample_gpu=part.sample_gpu,
        sample_mb=part.sample_mb,
        load=part.load,
        cluster=kit.cluster,
        model=kit.model,
        cost=kit.cost,
        prev_home=part.prev_home,
        history=part.history,
        seed=part.seed,
    )


def _kit() -> _Kit:
    if _WORKER_KIT is None:
        raise RuntimeError(
            "control-plane task ran in a process without a kit (start it through ControlPlane)"
        )
    return _WORKER_KIT


def _reorder_task(part: _Slice, kit: _Kit | None = None) -> tuple[np.ndarray, dict[str, float], float]:
    """One layer's placement -> (home int32 [E], stats, seconds)."""
    t0 = time.perf_counter()
    kit = kit or _kit()
    reorderer = kit.reorderer
    assert reorderer is not None
    ctx = _context(kit, part)
    if isinstance(reorderer, StagedReorderer):
        reo = reorderer.place(ctx, layers=(part.layer,))
    else:
        reo = reorderer.reorder(ctx)
    if not np.array_equal(np.asarray(reo.sample_gpu), part.sample_gpu):
        raise ValueError(
            f"the reorderer {type(reorderer).__name__} moved samples in a one-layer task; a locality round "
            "needs the whole batch: give the reorderer place() and locality_step() (StagedReorderer, as "
            "AnnealingReorderer has) so that the control plane runs it once every layer is placed"
        )
    return np.asarray(reo.home, dtype=np.int32)[0], dict(reo.stats), time.perf_counter() - t0


def _locality_task(
    part: _Slice, kit: _Kit | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, float], float]:
    """The whole batch's locality round under ``part.home`` [L, E] -> (sample_gpu int32 [Sb], load int32
    [Mb, L, G, E] regrouped under it, stats, seconds)."""
    t0 = time.perf_counter()
    kit = kit or _kit()
    reorderer = kit.reorderer
    assert isinstance(reorderer, StagedReorderer) and part.home is not None
    ctx = _context(kit, part)
    sample_gpu, stats = reorderer.locality_step(ctx, part.home)
    sample_gpu = np.asarray(sample_gpu, dtype=np.int32)
    if sample_gpu.shape != part.sample_gpu.shape:
        raise ValueError(
            f"locality_step returned sample_gpu of shape {sample_gpu.shape}; expected "
            f"[Sb]={part.sample_gpu.shape}"
        )
    moved = not np.array_equal(sample_gpu, part.sample_gpu)
    load = np.asarray(ctx.regroup(sample_gpu)[0] if moved and ctx.regroup else part.load, dtype=np.int32)
    return sample_gpu, load, dict(stats), time.perf_counter() - t0


def _replicate_task(
    part: _Slice, kit: _Kit | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, float], float]:
    """One layer's replication for every micro-batch -> (assign [Mb, E, G], replicas [Mb, G, r], stats, s)."""
    t0 = time.perf_counter()
    kit = kit or _kit()
    assert kit.replicator is not None and part.home is not None
    ctx = _context(kit, part)
    reps = replicate_batch(kit.replicator, part.load, part.home, ctx, part.sample_gpu)
    assign = np.stack([r.assign[0] for r in reps]).astype(np.int32)
    replicas = np.stack([r.replicas[0] for r in reps]).astype(np.int32)
    stats: dict[str, float] = {}
    for key in sorted({k for r in reps for k in r.stats}):
        stats[key] = float(np.mean([r.stats[key] for r in reps if key in r.stats]))
    return assign, replicas, stats, time.perf_counter() - t0


def _plan_task(part: _Slice, kit: _Kit | None = None) -> tuple[BatchPlan, float]:
    """A whole-batch planner's plan -> (plan, seconds)."""
    t0 = time.perf_counter()
    kit = kit or _kit()
    assert kit.planner is not None
    return kit.planner.plan(_context(kit, part)), time.perf_counter() - t0


# ------------------------------------------------------------------------------- coordinator side
_PHASE_ORDER = {"locality": 0, "reorder": 1, "replicate": 0, "batch": 0}
"""Within one layer's priority, replication (finishing a layer) goes before the next layer's reordering;
the locality round (layer -1) goes before the batch's replications, which wait for it."""


@dataclass
class _Task:
    job: int
    layer: int
    """Batch-wide layer index (-1 for the locality round, 0 for a whole-batch plan)."""
    phase: str
    fn: Callable[..., Any]
    part: _Slice
    attempts: int = 0

    def key(self) -> tuple[int, int, int]:
        return (self.job, self.layer, _PHASE_ORDER[self.phase])


@dataclass(frozen=True)
class _Assembled:
    """Stage 1's output for one batch."""

    layout: SampleLayout
    local_mb: np.ndarray
    """int32 [Sb]: micro-batch of each sample local to the batch."""
    load: np.ndarray
    """int32 [Mb, L, G, E]."""
    seconds: float


@dataclass
class _Job:
    """Mutable planning state of one batch (guarded by the control plane's lock)."""

    batch: int
    """The control plane's batch index (the key of :meth:`ControlPlane.plans`)."""
    counts: np.ndarray
    """int32 [Sb, L, E] in planning (sample id) order."""
    sample_tokens: np.ndarray
    """int64 [Sb]."""
    prev_home: np.ndarray
    """int32 [L, E]: the placement in effect before this batch (the fallback)."""
    t_arrival: float
    seed: int
    """The batch's planning seed (``BatchContext.seed``)."""
    ctx_batch: int
    """``BatchContext.batch`` of the batch's tasks (the simulator's index for :meth:`ControlPlane.plan`)."""
    reorder_prev: np.ndarray | None
    """int32 [L, E] or None: ``BatchContext.prev_home`` seen by the reorderer."""
    given: _Assembled | None = None
    """A layout and loads handed in with the batch (:meth:`ControlPlane.plan`)."""
    history: tuple[np.ndarray, ...] = ()
    asm: _Assembled | None = None
    load: np.ndarray | None = None
    """int32 [Mb, L, G, E]: the loads replication runs on (regrouped once the locality round is done)."""
    sample_gpu: np.ndarray | None = None
    """int32 [Sb]: the sample assignment of ``load``."""
    home: np.ndarray | None = None
    """int32 [L, E]: reordered layers' placement (the previous one elsewhere)."""
    assign: np.ndarray | None = None
    """int32 [Mb, L, E, G]."""
    replicas: np.ndarray | None = None
    """int32 [Mb, L, G, r]."""
    whole: BatchPlan | None = None
    reordered: np.ndarray | None = None
    placed: np.ndarray | None = None
    """bool [L]: the layer's placement is in (reordered, or its reordering failed)."""
    done: np.ndarray | None = None
    failed_reorder: np.ndarray | None = None
    failed_replicate: np.ndarray | None = None
    layer_ready: np.ndarray | None = None
    locality: LocalityStatus = LocalityStatus.OFF
    locality_pending: bool = False
    """The locality round is due and has not ended (ran, failed or timed out) yet."""
    locality_s: float = math.nan
    reorder_stats: dict[str, float] = field(default_factory=dict)
    locality_stats: dict[str, float] = field(default_factory=dict)
    replicate_stats: list[dict[str, float]] = field(default_factory=list)
    cpu_s: float = 0.0
    retries: int = 0
    crashes: int = 0
    errors: list[str] = field(default_factory=list)
    t_all: float = math.nan
    delivered: bool = False
    report: PlanReport | None = None

    @property
    def finished(self) -> bool:
        return self.done is not None and bool(self.done.all())

    def start(self, asm: _Assembled, replica_slots: int, num_gpus: int, locality: bool) -> None:
        """Initial state after assembly: every layer on the previous placement, home only."""
        num_mb, num_layers, _, num_experts = asm.load.shape
        self.asm = asm
        self.load = asm.load
        self.sample_gpu = asm.layout.sample_gpu
        self.home = self.prev_home.copy()
        self.assign = home_assign(
            asm.load, np.broadcast_to(self.home, (num_mb, num_layers, num_experts)), num_gpus
        )
        self.replicas = np.full((num_mb, num_layers, num_gpus, replica_slots), -1, dtype=np.int32)
        self.reordered = np.zeros(num_layers, dtype=bool)
        self.placed = np.zeros(num_layers, dtype=bool)
        self.done = np.zeros(num_layers, dtype=bool)
        self.failed_reorder = np.zeros(num_layers, dtype=bool)
        self.failed_replicate = np.zeros(num_layers, dtype=bool)
        self.layer_ready = np.full(num_layers, math.nan)
        self.locality_pending = locality


@dataclass
class _Slot:
    pool: ProcessPoolExecutor | None
    task: _Task | None = None
    started: float = math.nan
    """When ``task`` was handed to the worker."""
    generation: int = 0
    """Bumped whenever the worker is replaced, so a replaced worker's late answer is ignored."""


class ControlPlane:
    """Plans batches in worker processes as samples arrive; hands out plans by a deadline (module doc).

    Implements :class:`relibra.planners.protocols.Planner` too (:meth:`plan` takes a ready
    :class:`BatchContext`), so the simulator and the entry point can use it in place of the planner it wraps.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelSpec,
        cost: CostModel,
        *,
        reorderer: Reorderer | None = None,
        replicator: Replicator | None = None,
        planner: Planner | None = None,
        replica_slots: int = 0,
        name: str | None = None,
        config: ControlPlaneConfig | None = None,
    ) -> None:
        if (reorderer is None) != (replicator is None):
            raise ValueError("give both reorderer and replicator (a composition), or a whole-batch planner")
        if reorderer is None and planner is None:
            raise ValueError("give a reorderer and a replicator, or a whole-batch planner")
        self.cluster, self.model, self.cost = cluster, model, cost
        self.config = config or ControlPlaneConfig()
        self.replica_slots = int(replica_slots)
        self.slot_budget = (
            planner.slot_budget if planner is not None else SlotBudget(replica_slots=self.replica_slots)
        )
        """The slots of the planner it runs (a composition's: ``replica_slots`` of the buffer)."""
        self.per_layer = reorderer is not None
        self.name = name or (planner.name if planner is not None else "control_plane")
        self._kit = _Kit(
            cluster, model, cost, reorderer, replicator, None if reorderer else planner, replica_slots
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._events: queue.Queue[Any] = queue.Queue()
        self._ready: list[tuple[tuple[int, int, int], int, _Task]] = []
        self._warm_futures: list[Future[Any]] = []
        self._tiebreak = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._open: list[tuple[np.ndarray, np.ndarray, np.ndarray, float]] = []
        self._next_id = 0
        self._next_batch = 0
        self._placement = static_placement(model.num_moe_layers, model.num_experts, cluster.num_gpus)
        self._closed = False
        t0 = time.perf_counter()
        self._slots = [_Slot(self._new_pool()) for _ in range(self.config.workers)] or [_Slot(None)]
        if self.config.warm_up:
            for slot, fut in [(s, s.pool.submit(_warm)) for s in self._slots if s.pool is not None]:
                if fut.exception() is not None:  # NOTE: a planner that fails here fails its tasks later.
                    self._kill(slot.pool)
                    slot.pool = self._new_pool()
        self.startup_s = time.perf_counter() - t0
        """Seconds spent starting the worker processes."""
        self._thread = threading.Thread(target=self._loop, name="relibra-control-plane", daemon=True)
        self._thread.start()

    @classmethod
    def from_planner(
        cls,
        planner: Planner,
        cluster: ClusterSpec,
        model: ModelSpec,
        cost: CostModel,
        config: ControlPlaneConfig | None = None,
    ) -> ControlPlane:
        """Wrap ``planner``: split per layer when it is a :class:`~relibra.planners.protocols.StagedPlanner`
        (a reorderer then a replicator), else run it as one whole-batch task."""
        reorderer: Reorderer | None = None
        replicator: Replicator | None = None
        if isinstance(planner, StagedPlanner):
            reorderer, replicator = planner.reorderer, planner.replicator
        return cls(
            cluster,
            model,
            cost,
            reorderer=reorderer,
            replicator=replicator,
            planner=planner,
            replica_slots=planner.slot_budget.replica_slots,
            name=str(planner.name),
            config=config,
        )

    # ---------------------------------------------------------------------------- the trainer's calls
    def submit(
        self,
        samples: SampleCounts | RoutingTrace | np.ndarray,
        tokens: np.ndarray | None = None,
        sample_ids: np.ndarray | None = None,
    ) -> None:
        """Add samples of the open batch as they come back from rollout (never blocks on planning).

        Args:
            samples: a :class:`SampleCounts` or :class:`RoutingTrace` of some samples (all their batches
                are taken as this batch's samples), or per-sample counts int [s, L, E] with ``tokens``.
            tokens: int64 [s] tokens per sample (only with a counts array).
            sample_ids: int [s] the samples' ids in the batch (e.g. their prompt index); planning sorts by
                them so that the order of arrival never changes the plan. Default: arrival order.
        """
        if isinstance(samples, RoutingTrace):
            samples = samples.to_counts()
        if isinstance(samples, SampleCounts):
            counts, toks = samples.counts, samples.tokens
        else:
            if tokens is None:
                raise ValueError("a counts array [s, L, E] needs tokens [s] (tokens per sample)")
            counts, toks = np.asarray(samples), np.asarray(tokens, dtype=np.int64)
        expect = (self.model.num_moe_layers, self.model.num_experts)
        if counts.ndim != 3 or counts.shape[1:] != expect:
            raise ValueError(f"counts must be [s, L, E] with (L, E)={expect}, got shape {counts.shape}")
        if toks.shape != (counts.shape[0],):
            raise ValueError(f"tokens must be [s]=({counts.shape[0]},), got shape {toks.shape}")
        with self._lock:
            ids = (
                np.arange(self._next_id, self._next_id + counts.shape[0], dtype=np.int64)
                if sample_ids is None
                else np.asarray(sample_ids, dtype=np.int64)
            )
            if ids.shape != toks.shape:
                raise ValueError(f"sample_ids must be [s]=({counts.shape[0]},), got shape {ids.shape}")
            self._next_id += counts.shape[0]
            self._open.append((np.asarray(counts, dtype=np.int32), toks, ids, time.perf_counter()))

    def seal(self) -> int:
        """Close the open batch and start planning it. Returns its batch index (0, 1, ...)."""
        with self._lock:
            if not self._open:
                raise ValueError("seal() with no submitted samples; submit() the batch's samples first")
            counts = np.concatenate([c for c, _, _, _ in self._open])
            tokens = np.concatenate([t for _, t, _, _ in self._open])
            ids = np.concatenate([i for _, _, i, _ in self._open])
            if np.unique(ids).size != ids.size:
                raise ValueError("sample_ids repeat within the batch; every sample needs its own id")
            t_arrival = max(t for _, _, _, t in self._open)
            self._open, self._next_id = [], 0
            perm = np.argsort(ids, kind="stable")
            job = _Job(
                batch=self._next_batch,
                counts=counts[perm],
                sample_tokens=tokens[perm],
                prev_home=self._placement.copy(),
                t_arrival=t_arrival,
                seed=self.config.seed + self._next_batch,
                ctx_batch=self._next_batch,
                reorder_prev=self._placement.copy(),
            )
            return self._start(job)

    def plans(self, batch: int, deadline_s: float | None = None) -> BatchPlan:
        """The plan of ``batch``, waiting at most ``deadline_s`` seconds (None: config default, then forever).

        Layers not planned by then fall back (see module doc); the result covers every layer and every
        sample (in id order). Planning of this batch stops; its :class:`PlanReport` is fixed.
        """
        wait = self.config.deadline_s if deadline_s is None else deadline_s
        t0 = time.perf_counter()
        with self._cond:
            job = self._jobs.get(batch)
            if job is None:
                raise KeyError(f"batch {batch} was never sealed (sealed: {sorted(self._jobs)})")
            if job.delivered:
                raise ValueError(f"batch {batch} was already delivered; plans() hands out each batch once")
            end = None if wait is None else t0 + wait
            while not job.finished:
                left = None if end is None else end - time.perf_counter()
                if left is not None and left <= 0:
                    break
                self._cond.wait(timeout=left)
            plan = self._deliver(job, time.perf_counter() - t0)
            self._placement = plan.home.copy()
        return plan

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """:class:`~relibra.planners.protocols.Planner` protocol: plan a ready context through the workers.

        Uses the context's layout, loads, ``prev_home``, ``history``, ``batch`` and ``seed`` (the
        simulator's), so the plan equals the wrapped planner's ``plan(ctx)``, and waits
        ``config.deadline_s``. Timing starts at this call (the context is the last arrival).
        """
        t0 = time.perf_counter()
        num_mb = int(np.shape(ctx.load)[0])
        given = _Assembled(
            layout=SampleLayout(
                sample_gpu=np.asarray(ctx.sample_gpu, dtype=np.int32),
                sample_mb=np.asarray(ctx.sample_mb, dtype=np.int32),
                mb_batch=np.zeros(num_mb, dtype=np.int32),
            ),
            local_mb=np.asarray(ctx.sample_mb, dtype=np.int32),
            load=np.asarray(ctx.load, dtype=np.int32),
            seconds=0.0,
        )
        num_layers, num_experts = np.shape(ctx.counts)[1:]
        prev = (
            np.asarray(ctx.prev_home, dtype=np.int32)
            if ctx.prev_home is not None
            else static_placement(num_layers, num_experts, self.cluster.num_gpus)
        )
        with self._lock:
            job = _Job(
                batch=self._next_batch,
                counts=np.asarray(ctx.counts),
                sample_tokens=np.asarray(ctx.sample_tokens, dtype=np.int64),
                prev_home=prev,
                t_arrival=t0,
                seed=int(ctx.seed),
                ctx_batch=int(ctx.batch),
                reorder_prev=None if ctx.prev_home is None else prev,
                given=given,
                history=tuple(ctx.history),
            )
            key = self._start(job)
        return self.plans(key)

    def report(self, batch: int) -> PlanReport:
        """The :class:`PlanReport` of a delivered batch."""
        with self._lock:
            job = self._jobs.get(batch)
            if job is None or not job.delivered:
                raise KeyError(f"batch {batch} has no report yet: call plans({batch}) first")
            assert job.report is not None
            return job.report

    def close(self) -> None:
        """Stop the coordinator and the workers (running tasks are abandoned)."""
        if self._closed:
            return
        self._closed = True
        self._events.put(None)
        self._thread.join()
        for slot in self._slots:
            self._kill(slot.pool)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context(self.config.mp_context),
            initializer=_init_worker,
            initargs=(self._kit,),
        )

    def _replace_worker(self, slot: _Slot) -> None:
        """Kill ``slot``'s worker and start a fresh one (warmed in the background when configured)."""
        self._kill(slot.pool)
        slot.pool = self._new_pool()
        slot.generation += 1
        slot.task = None
        if self.config.warm_up:
            # NOTE: queued ahead of the worker's next task; a failure there fails that task, not this call.
            self._warm_futures = [f for f in self._warm_futures if not f.done()]
            self._warm_futures.append(slot.pool.submit(_warm))

    @staticmethod
    def _kill(pool: ProcessPoolExecutor | None) -> None:
        if pool is None:
            return
        # NOTE: shutdown() cannot stop a running task; terminate the (single) process so that a hung or
        # late task neither lingers nor keeps the interpreter from exiting.
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join(timeout=5)

    def _start(self, job: _Job) -> int:
        """Register ``job`` (lock held) and hand it to the coordinator."""
        self._jobs[job.batch] = job
        self._next_batch += 1
        self._events.put(("seal", job))
        return job.batch

    def _loop(self) -> None:
        while True:
            with self._lock:
                wake = self._next_expiry()
            try:
                event = self._events.get(timeout=wake)
            except queue.Empty:
                event = ("tick",)
            if event is None:
                return
            kind, *payload = event
            if kind == "seal":
                job = payload[0]
                asm = self._assemble(job)  # NOTE: outside the lock so that the trainer's calls stay quick.
            with self._cond:
                if kind == "seal":
                    self._enqueue_first(job, asm)
                elif kind == "done":
                    self._finish(*payload)
                self._expire()
                self._dispatch()
                self._cond.notify_all()

    def _next_expiry(self) -> float | None:
        """Seconds until the earliest running locality round passes its own deadline (lock held)."""
        limit = self.config.locality_deadline_s
        if limit is None:
            return None
        ends = [s.started + limit for s in self._slots if s.task is not None and s.task.phase == "locality"]
        return max(0.0, min(ends) - time.perf_counter()) if ends else None

    def _expire(self) -> None:
        """Stop locality rounds past their deadline (lock held): replace the worker, keep the input
        samples, release the batch's replications."""
        limit = self.config.locality_deadline_s
        if limit is None:
            return
        now = time.perf_counter()
        for slot in self._slots:
            task = slot.task
            if task is None or task.phase != "locality" or now - slot.started < limit:
                continue
            self._replace_worker(slot)
            job = self._jobs[task.job]
            if not job.delivered:
                self._locality_fallback(
                    job, LocalityStatus.TIMED_OUT, f"ran past locality_deadline_s={limit}"
                )

    def _assemble(self, job: _Job) -> _Assembled:
        """Stage 1: layout and loads of ``job`` (or the ones it was given)."""
        if job.given is not None:
            return job.given
        t0 = time.perf_counter()
        g = self.cluster.num_gpus
        layout = layout_samples(
            job.sample_tokens,
            np.array([0, job.counts.shape[0]], dtype=np.int64),
            g,
            self.config.samples_per_microbatch,
            self.config.tokens_per_microbatch,
            self.config.layout,
        )
        local_mb = layout.local_mb()
        load = microbatch_loads(job.counts, layout.sample_gpu, local_mb, layout.num_microbatches, g)
        return _Assembled(layout, local_mb, load, time.perf_counter() - t0)

    def _part(self, job: _Job, layers: slice, phase: str, home: np.ndarray | None = None) -> _Slice:
        asm, load, sample_gpu = job.asm, job.load, job.sample_gpu
        assert asm is not None and load is not None and sample_gpu is not None
        first = layers.start or 0
        seed = job.seed
        if phase == "reorder" and not self._kit.staged:
            # NOTE: a plain reorderer sees a one-layer context without its index: one seed per (batch, layer)
            # keeps layers apart, and a plan independent of how layers meet workers.
            seed = int(np.random.SeedSequence([job.seed, job.ctx_batch, first]).generate_state(1)[0])
        return _Slice(
            batch=job.ctx_batch,
            counts=np.ascontiguousarray(job.counts[:, layers]),
            sample_tokens=job.sample_tokens,
            sample_gpu=sample_gpu,
            sample_mb=asm.local_mb,
            load=np.ascontiguousarray(load[:, layers]),
            prev_home=None if job.reorder_prev is None else job.reorder_prev[layers],
            seed=seed,
            layer=first,
            home=home,
            history=job.history if phase == "batch" else (),
        )

    def _push(self, task: _Task) -> None:
        heapq.heappush(self._ready, (task.key(), next(self._tiebreak), task))

    def _enqueue_first(self, job: _Job, asm: _Assembled) -> None:
        if job.delivered:
            return
        job.start(asm, self.replica_slots, self.cluster.num_gpus, self.per_layer and self._kit.locality)
        if job.locality_pending:
            job.locality = LocalityStatus.NOT_READY
        num_layers = job.prev_home.shape[0]
        if self.per_layer:
            for layer in range(num_layers):
                part = self._part(job, slice(layer, layer + 1), "reorder")
                self._push(_Task(job.batch, layer, "reorder", _reorder_task, part))
        else:
            self._push(_Task(job.batch, 0, "batch", _plan_task, self._part(job, slice(None), "batch")))

    def _dispatch(self) -> None:
        """Give ready tasks to idle workers (lock held)."""
        for index, slot in enumerate(self._slots):
            if slot.task is not None:
                continue
            task = None
            while self._ready:
                _, _, cand = heapq.heappop(self._ready)
                if not self._jobs[cand.job].delivered:
                    task = cand
                    break
            if task is None:
                return
            slot.task = task
            slot.started = time.perf_counter()
            task.attempts += 1
            if slot.pool is None:
                fut: Future[Any] = Future()
                try:
                    fut.set_result(task.fn(task.part, self._kit))
                except Exception as err:  # NOTE: reported as the task's failure, like a worker's.
                    fut.set_exception(err)
                self._events.put(("done", index, slot.generation, task, fut))
            else:
                fut = slot.pool.submit(task.fn, task.part)
                fut.add_done_callback(self._on_done(index, slot.generation, task))

    def _on_done(self, index: int, generation: int, task: _Task) -> Callable[[Future[Any]], None]:
        def callback(fut: Future[Any]) -> None:
            self._events.put(("done", index, generation, task, fut))

        return callback

    def _finish(self, index: int, generation: int, task: _Task, fut: Future[Any]) -> None:
        """A task ended (lock held): store its result, re-run it, or fall back."""
        slot = self._slots[index]
        if generation != slot.generation or slot.task is not task:
            return  # NOTE: the answer of a worker replaced since (a locality round past its deadline).
        slot.task = None
        job = self._jobs[task.job]
        err = fut.exception()
        if isinstance(err, BrokenProcessPool):
            job.crashes += 1
            self._replace_worker(slot)
            if task.attempts <= self.config.max_retries and not job.delivered:
                job.retries += 1
                self._push(task)
                return
        if job.delivered:
            return
        now = time.perf_counter()
        if err is not None:
            self._fail(job, task, f"{type(err).__name__}: {err}")
            return
        result = fut.result()
        layer = task.layer
        assert job.home is not None and job.done is not None and job.reordered is not None
        if task.phase == "reorder":
            home, stats, secs = result
            job.cpu_s += secs
            for key, value in stats.items():
                job.reorder_stats[key] = job.reorder_stats.get(key, 0.0) + float(value)
            job.home[layer] = home
            job.reordered[layer] = True
            self._placed(job, layer)
        elif task.phase == "locality":
            sample_gpu, load, stats, secs = result
            job.cpu_s += secs
            limit = self.config.locality_deadline_s
            if limit is not None and secs > limit:  # NOTE: inline runs cannot be stopped, only discarded.
                self._locality_fallback(
                    job, LocalityStatus.TIMED_OUT, f"took {secs:.3f}s > locality_deadline_s={limit}"
                )
                return
            job.sample_gpu, job.load = sample_gpu, load
            job.locality_stats = dict(stats)
            job.locality_s = secs
            self._locality_end(job, LocalityStatus.DONE)
        elif task.phase == "replicate":
            assign, replicas, stats, secs = result
            assert job.assign is not None and job.replicas is not None and job.layer_ready is not None
            job.cpu_s += secs
            job.assign[:, layer], job.replicas[:, layer] = assign, replicas
            job.replicate_stats.append(stats)
            job.done[layer] = True
            job.layer_ready[layer] = now - job.t_arrival
        else:
            plan, secs = result
            assert job.layer_ready is not None
            job.cpu_s += secs
            job.whole = plan
            job.done[:] = True
            job.reordered[:] = True
            job.layer_ready[:] = now - job.t_arrival
        if job.finished:
            job.t_all = now

    def _placed(self, job: _Job, layer: int) -> None:
        """Layer ``layer``'s placement is in (lock held): replicate it, or, when a locality round is due,
        start that round once every layer is placed."""
        assert job.placed is not None and job.home is not None
        job.placed[layer] = True
        if not job.locality_pending:
            self._push_replicate(job, layer)
        elif job.placed.all():
            part = self._part(job, slice(None), "locality", home=job.home.copy())
            self._push(_Task(job.batch, -1, "locality", _locality_task, part))

    def _locality_end(self, job: _Job, status: LocalityStatus) -> None:
        """The locality round ended with ``status`` (lock held): replicate every layer on ``job.load``."""
        job.locality = status
        job.locality_pending = False
        for layer in range(job.prev_home.shape[0]):
            self._push_replicate(job, layer)

    def _locality_fallback(self, job: _Job, status: LocalityStatus, why: str) -> None:
        """Keep the input sample assignment (lock held); ``job.load`` is still the input loads."""
        job.errors.append(f"batch locality: {why}")
        self._locality_end(job, status)

    def _push_replicate(self, job: _Job, layer: int) -> None:
        assert job.home is not None
        part = self._part(job, slice(layer, layer + 1), "replicate", home=job.home[layer : layer + 1].copy())
        self._push(_Task(job.batch, layer, "replicate", _replicate_task, part))

    def _fail(self, job: _Job, task: _Task, why: str) -> None:
        """Record a failed task (lock held); its layer falls back, a failed reordering is placed on the
        previous placement, a failed locality round keeps the input samples."""
        assert job.done is not None and job.failed_reorder is not None and job.failed_replicate is not None
        if task.phase == "locality":
            self._locality_fallback(job, LocalityStatus.FAILED, why)
            return
        job.errors.append(f"layer {task.layer} {task.phase}: {why}")
        if task.phase == "reorder":
            job.failed_reorder[task.layer] = True
            self._placed(job, task.layer)  # job.home[layer] is still the previous placement
            return
        if task.phase == "replicate":
            job.failed_replicate[task.layer] = True
            job.done[task.layer] = True
        else:
            job.failed_reorder[:] = job.failed_replicate[:] = True
            job.done[:] = True
        if job.finished:
            job.t_all = time.perf_counter()

    def _deliver(self, job: _Job, waited: float) -> BatchPlan:
        """Freeze ``job`` into a plan with fallbacks (lock held)."""
        job.delivered = True
        now = time.perf_counter()
        g = self.cluster.num_gpus
        if job.asm is None:
            # NOTE: the deadline came before assembly ended: assemble here (the plan needs the loads).
            job.start(self._assemble(job), self.replica_slots, g, self.per_layer and self._kit.locality)
            if job.locality_pending:
                job.locality = LocalityStatus.NOT_READY
        asm = job.asm
        assert asm is not None and job.done is not None and job.reordered is not None and job.home is not None
        assert job.assign is not None and job.replicas is not None and job.layer_ready is not None
        assert job.failed_reorder is not None and job.failed_replicate is not None
        assert job.load is not None and job.sample_gpu is not None
        fallback = np.zeros(job.done.shape[0], dtype=np.int8)
        fallback[~job.reordered | job.failed_reorder] |= Fallback.PREVIOUS_PLACEMENT
        fallback[~job.done | job.failed_replicate] |= Fallback.NO_REPLICATION
        home = np.where(job.reordered[:, None] & ~job.failed_reorder[:, None], job.home, job.prev_home)
        home = home.astype(np.int32)
        online = None
        if job.whole is not None and not job.failed_reorder.any():
            plan = job.whole
            home = np.asarray(plan.home, dtype=np.int32)
            assign, replicas, load = plan.assign, plan.replicas, plan.load
            sample_gpu, redundant, stats = plan.sample_gpu, plan.redundant, dict(plan.stats)
            online = plan.online
        else:
            assign, replicas, load = job.assign.copy(), job.replicas.copy(), job.load
            sample_gpu, redundant = job.sample_gpu, None
            late = fallback.astype(bool)
            if late.any():
                assign[:, late] = home_assign(
                    load[:, late], np.broadcast_to(home[late], (load.shape[0], *home[late].shape)), g
                )
                replicas[:, late] = -1
            stats = dict(job.reorder_stats)
            stats.update(job.locality_stats)
            for key in sorted({k for s in job.replicate_stats for k in s}):
                stats[key] = float(np.mean([s[key] for s in job.replicate_stats if key in s]))
            stats["replicas_mean"] = float((replicas >= 0).sum(axis=-1).mean()) if replicas.size else 0.0
        stats["reorder_moved_experts"] = float(np.count_nonzero(home != job.prev_home))
        ready = job.layer_ready
        first = float(np.nanmin(ready)) if np.isfinite(ready).any() else math.nan
        t_all = job.t_all - job.t_arrival if job.finished else math.nan
        report = PlanReport(
            batch=job.batch,
            fallback=fallback,
            layer_ready_s=ready.copy(),
            time_to_first_plan_s=first,
            time_to_all_plans_s=t_all,
            assemble_s=asm.seconds,
            plan_cpu_s=job.cpu_s,
            wait_s=waited,
            retries=job.retries,
            worker_crashes=job.crashes,
            errors=tuple(job.errors),
            locality=job.locality,
            locality_s=job.locality_s,
        )
        job.report = report
        # NOTE: only measured timings go into the stats (a stage that did not run has no time, not NaN).
        cp_stats = {
            "cp_time_to_first_plan_s": first,
            "cp_time_to_all_plans_s": t_all,
            "cp_plan_cpu_s": job.cpu_s,
            "cp_assemble_s": asm.seconds,
            "cp_wait_s": waited,
            "cp_previous_placement_layers": float(report.previous_placement_layers),
            "cp_no_replication_layers": float(report.no_replication_layers),
            "cp_locality_fallback": float(report.locality_fallback),
            "cp_locality_s": job.locality_s,
            "cp_retries": float(job.retries),
            "cp_worker_crashes": float(job.crashes),
        }
        stats.update({k: v for k, v in cp_stats.items() if math.isfinite(v)})
        plan = BatchPlan(
            home=home,
            assign=np.asarray(assign, dtype=np.int32),
            load=np.asarray(load, dtype=np.int32),
            sample_gpu=np.asarray(sample_gpu, dtype=np.int32),
            replicas=None if replicas is None else np.asarray(replicas, dtype=np.int32),
            redundant=redundant,
            plan_time_s=t_all if job.finished else now - job.t_arrival,
            stats=stats,
            online=online,
        )
        if (job.whole is None or job.failed_reorder.any()) and not fallback.any():
            # NOTE: as the serial planner does (ComposedPlanner.plan), keep experts where they were among
            # the equivalent relabellings of the delivered plan; a whole-batch plan relabelled itself, and
            # a plan with fallbacks is left as it is (a late layer keeps its previous placement exactly).
            nodes = self.cluster.nodes
            plan = relabel_plan(plan, job.prev_home, nodes, self.cluster.gpus_per_node)
        return plan
