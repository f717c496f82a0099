"""The coordinator's bookkeeping of one batch: its tasks, assembled workload, planning state and worker
slots (all mutated under the control plane's lock)."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relibra.control.report import LocalityStatus, PlanReport
from relibra.control.tasks import TaskSlice
from relibra.layout import SampleLayout
from relibra.planners.protocols import (
    home_assign,
)
from relibra.types import BatchPlan

__all__ = ["PHASE_ORDER", "Assembled", "Job", "Slot", "Task"]


PHASE_ORDER = {"locality": 0, "reorder": 1, "replicate": 0, "batch": 0}
"""Within one layer's priority, replication (finishing a layer) goes before the next layer's reordering;
the locality round (layer -1) goes before the batch's replications, which wait for it."""


@dataclass
class Task:
    job: int
    layer: int
    """Batch-wide layer index (-1 for the locality round, 0 for a whole-batch plan)."""
    phase: str
    fn: Callable[..., Any]
    part: TaskSlice
    attempts: int = 0

    def key(self) -> tuple[int, int, int]:
        return (self.job, self.layer, PHASE_ORDER[self.phase])


@dataclass(frozen=True)
class Assembled:
    """Stage 1's output for one batch."""

    layout: SampleLayout
    local_mb: np.ndarray
    """int32 [Sb]: micro-batch of each sample local to the batch."""
    load: np.ndarray
    """int32 [Mb, L, G, E]."""
    seconds: float
    counts: np.ndarray | None = None
    """int32 [Sb * h, L, E]: the counts the planners see when they are not the batch's own, the ranks of
    each sample under ``tp * cp > 1`` (:mod:`relibra.control.assembly`); None: the job's ``counts``."""
    sample_tokens: np.ndarray | None = None
    """int64 [Sb * h]: the tokens of those rows (None with ``counts``)."""


@dataclass
class Job:
    """Mutable planning state of one batch (guarded by the control plane's lock)."""

    batch: int
    """The control plane's batch index (the key of :meth:`ControlPlane.plans`)."""
    counts: np.ndarray
    """int32 [Sb, L, E] in planning (sample id) order (the planners see :attr:`Assembled.counts` instead
    where assembly split the samples into ranks: :meth:`part`)."""
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
    given: Assembled | None = None
    """A layout and loads handed in with the batch (:meth:`ControlPlane.plan`)."""
    history: tuple[np.ndarray, ...] = ()
    prev_redundant: np.ndarray | None = None
    """int32 [L, G, W] or None: ``BatchContext.prev_redundant`` (whole-batch planners)."""
    asm: Assembled | None = None
    load: np.ndarray | None = None
    """int32 [Mb, L, G, E]: the loads replication runs on (regrouped once the locality round is done)."""
    sample_gpu: np.ndarray | None = None
    """int32 [Sb] (or [Sb * h], a rank of a sample each, :attr:`Assembled.counts`): the sample assignment
    of ``load``."""
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

    def start(self, asm: Assembled, replica_slots: int, num_gpus: int, locality: bool) -> None:
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

    def part(self, layers: slice, phase: str, staged: bool, home: np.ndarray | None = None) -> TaskSlice:
        """What a worker gets for ``phase`` on ``layers`` of this assembled batch (``staged``: the
        reorderer runs its per-layer round with the layer's batch-wide index)."""
        asm, load, sample_gpu = self.asm, self.load, self.sample_gpu
        assert asm is not None and load is not None and sample_gpu is not None
        first = layers.start or 0
        seed = self.seed
        if phase == "reorder" and not staged:
            # NOTE: a plain reorderer sees a one-layer context without its index: one seed per (batch, layer)
            # keeps layers apart, and a plan independent of how layers meet workers.
            seed = int(np.random.SeedSequence([self.seed, self.ctx_batch, first]).generate_state(1)[0])
        counts = self.counts if asm.counts is None else asm.counts
        tokens = self.sample_tokens if asm.sample_tokens is None else asm.sample_tokens
        return TaskSlice(
            batch=self.ctx_batch,
            counts=np.ascontiguousarray(counts[:, layers]),
            sample_tokens=tokens,
            sample_gpu=sample_gpu,
            sample_mb=asm.local_mb,
            load=np.ascontiguousarray(load[:, layers]),
            prev_home=None if self.reorder_prev is None else self.reorder_prev[layers],
            seed=seed,
            layer=first,
            home=home,
            history=self.history if phase == "batch" else (),
            prev_redundant=self.prev_redundant if phase == "batch" else None,
        )


@dataclass
class Slot:
    pool: ProcessPoolExecutor | None
    task: Task | None = None
    started: float = math.nan
    """When ``task`` was handed to the worker."""
    generation: int = 0
    """Bumped whenever the worker is replaced, so a replaced worker's late answer is ignored."""
