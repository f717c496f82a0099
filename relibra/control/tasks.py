"""The worker side of the control plane: the kit each worker holds, the arrays a task gets, and the four
tasks (one layer's placement, the batch's locality round, one layer's replication, a whole-batch plan)."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import (
    BatchContext,
    Planner,
    Reorderer,
    Replicator,
    StagedReorderer,
    static_placement,
)
from relibra.planners.refill import replicate_batch
from relibra.types import BatchPlan
from relibra.workload import microbatch_loads, sample_context

__all__ = [
    "TaskKit",
    "TaskSlice",
    "init_worker",
    "kill_worker",
    "locality_task",
    "new_worker",
    "plan_task",
    "reorder_task",
    "replicate_task",
    "task_context",
    "warm_worker",
]


@dataclass(frozen=True)
class TaskKit:
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


_WORKER_KIT: TaskKit | None = None
"""The worker process's kit. NOTE: process-global by necessity (a ProcessPoolExecutor initializer's only
way to hand state to later tasks); the coordinator process never sets it."""


def new_worker(kit: TaskKit, mp_context: str) -> ProcessPoolExecutor:
    """One worker process (a single-process pool) initialised with ``kit``."""
    return ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context(mp_context),
        initializer=init_worker,
        initargs=(kit,),
    )


def kill_worker(pool: ProcessPoolExecutor | None) -> None:
    """Stop ``pool``'s process now, a running task included."""
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


def init_worker(kit: TaskKit) -> None:
    global _WORKER_KIT
    _WORKER_KIT = kit


def warm_worker(kit: TaskKit | None = None) -> float:
    """Plan one small random layer (and its locality round) once per worker at start-up, so that process
    start, imports and loading (or compiling) the numba kernels are off the critical path. Returns its
    seconds. Compilation itself is cached on disk: see :mod:`relibra.planners.warmup`."""
    t0 = time.perf_counter()
    kit = kit or worker_kit()
    g, num_experts = kit.cluster.num_gpus, kit.model.num_experts
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 8, size=(g, 1, num_experts)).astype(np.int32)
    sample_gpu = np.arange(g, dtype=np.int32)
    part = TaskSlice(
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
        home, _, _ = reorder_task(part, kit)
        part = replace(part, home=home[None])
        if kit.locality:
            locality_task(part, kit)
        replicate_task(part, kit)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class TaskSlice:
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
    prev_redundant: np.ndarray | None = None
    """int32 [L, G, W] or None: the previous batch's redundant copies (whole-batch planners)."""


def task_context(kit: TaskKit, part: TaskSlice) -> BatchContext:
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
        prev_redundant=part.prev_redundant,
    )


def worker_kit() -> TaskKit:
    if _WORKER_KIT is None:
        raise RuntimeError(
            "control-plane task ran in a process without a kit (start it through ControlPlane)"
        )
    return _WORKER_KIT


def reorder_task(part: TaskSlice, kit: TaskKit | None = None) -> tuple[np.ndarray, dict[str, float], float]:
    """One layer's placement -> (home int32 [E], stats, seconds)."""
    t0 = time.perf_counter()
    kit = kit or worker_kit()
    reorderer = kit.reorderer
    assert reorderer is not None
    ctx = task_context(kit, part)
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


def locality_task(
    part: TaskSlice, kit: TaskKit | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, float], float]:
    """The whole batch's locality round under ``part.home`` [L, E] -> (sample_gpu int32 [Sb], load int32
    [Mb, L, G, E] regrouped under it, stats, seconds)."""
    t0 = time.perf_counter()
    kit = kit or worker_kit()
    reorderer = kit.reorderer
    assert isinstance(reorderer, StagedReorderer) and part.home is not None
    ctx = task_context(kit, part)
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


def replicate_task(
    part: TaskSlice, kit: TaskKit | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, float], float]:
    """One layer's replication for every micro-batch -> (assign [Mb, E, G], replicas [Mb, G, r], stats, s)."""
    t0 = time.perf_counter()
    kit = kit or worker_kit()
    assert kit.replicator is not None and part.home is not None
    ctx = task_context(kit, part)
    reps = replicate_batch(kit.replicator, part.load, part.home, ctx, part.sample_gpu)
    assign = np.stack([r.assign[0] for r in reps]).astype(np.int32)
    replicas = np.stack([r.replicas[0] for r in reps]).astype(np.int32)
    stats: dict[str, float] = {}
    for key in sorted({k for r in reps for k in r.stats}):
        stats[key] = float(np.mean([r.stats[key] for r in reps if key in r.stats]))
    return assign, replicas, stats, time.perf_counter() - t0


def plan_task(part: TaskSlice, kit: TaskKit | None = None) -> tuple[BatchPlan, float]:
    """A whole-batch planner's plan -> (plan, seconds)."""
    t0 = time.perf_counter()
    kit = kit or worker_kit()
    assert kit.planner is not None
    return kit.planner.plan(task_context(kit, part)), time.perf_counter() - t0
