"""The control plane: plans each batch in worker processes while the trainer does post-rollout processing.

NOTE: :class:`ControlPlane` is one state machine whose methods all read or write the job table, the task
heap and the worker slots under a single lock, from the trainer's thread and the coordinator thread; its
methods stay together so that the locking protocol is checkable in one place. What does not touch that
state lives beside it: stage 1 (the batch's layout and loads) in :mod:`relibra.control.assembly`, the
delivered plan with its fallbacks in :mod:`relibra.control.delivery`, the worker side in
:mod:`relibra.control.tasks`, a batch's bookkeeping in :mod:`relibra.control.jobs`, the settings in
:mod:`relibra.control.config`, the report in :mod:`relibra.control.report`.

The trainer's calls (docs/control_plane.md, "Control plane (trainer side)")::

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

Stages of one batch, after :meth:`ControlPlane.seal` (each in full: docs/control_plane.md, "Control plane
(trainer side)"): workload assembly on the coordinator thread (:mod:`relibra.control.assembly`: samples sorted
by id, laid out as the simulator lays them out, under the cost model's parallel dimensions), placement per
layer (a :class:`StagedReorderer`'s per-layer round, seeded by the batch and the layer's index), ReLibra's
locality round once every placement is in, and replication per layer on the (regrouped) loads. Tasks run in a
pool of ``workers`` single-process executors, lower layers first; a planner that is not a reorderer/replicator
composition runs as one whole-batch task. With the same seeds the delivered plan equals the serial planner's
(:class:`~relibra.planners.compose.ComposedPlanner`) exactly, for any worker count.

**Deadline and fallbacks** (the same section): :meth:`ControlPlane.plans` waits at most ``deadline_s``; a
layer whose reordering is not ready keeps the previous placement, one whose replication is not ready gets
none, each recorded in :class:`PlanReport`; the locality round has its own limit (``locality_deadline_s``) and
falls back to the input layout. A task that raises falls back at once; one whose worker dies is re-run up to
``max_retries`` times, then falls back; every delivered plan covers every layer.
Timing: :mod:`relibra.control.report`.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.control.assembly import assemble_batch, given_layout, submitted_samples
from relibra.control.config import ControlPlaneConfig
from relibra.control.delivery import freeze_plan
from relibra.control.jobs import Assembled, Job, Slot, Task
from relibra.control.report import LocalityStatus, PlanReport
from relibra.control.tasks import (
    TaskKit,
    kill_worker,
    locality_task,
    new_worker,
    plan_task,
    reorder_task,
    replicate_task,
    warm_worker,
)
from relibra.cost.model import CostModel
from relibra.layout import SampleLayout
from relibra.planners.protocols import (
    BatchContext,
    Planner,
    Reorderer,
    Replicator,
    SlotBudget,
    StagedPlanner,
    static_placement,
)
from relibra.trace.format import RoutingTrace
from relibra.types import BatchPlan, SampleCounts

__all__ = ["ControlPlane"]


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
        self.history_batches: int | None = getattr(planner, "history_batches", None)
        """The history the wrapped planner declares (:class:`~relibra.planners.protocols.HistoryNeeds`), so
        the simulator hands it through; None where it declares none."""
        self.per_layer = reorderer is not None
        self.name = name or (planner.name if planner is not None else "control_plane")
        self._kit = TaskKit(
            cluster, model, cost, reorderer, replicator, None if reorderer else planner, replica_slots
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._events: queue.Queue[Any] = queue.Queue()
        self._ready: list[tuple[tuple[int, int, int], int, Task]] = []
        self._warm_futures: list[Future[Any]] = []
        self._tiebreak = itertools.count()
        self._jobs: dict[int, Job] = {}
        self._open: list[tuple[np.ndarray, np.ndarray, np.ndarray, float]] = []
        self._next_id = 0
        self._next_batch = 0
        self._placement = static_placement(model.num_moe_layers, model.num_experts, cluster.num_gpus)
        self._closed = False
        t0 = time.perf_counter()
        self._slots = [
            Slot(new_worker(self._kit, self.config.mp_context)) for _ in range(self.config.workers)
        ] or [Slot(None)]
        if self.config.warm_up:
            for slot, fut in [(s, s.pool.submit(warm_worker)) for s in self._slots if s.pool is not None]:
                if fut.exception() is not None:  # NOTE: a planner that fails here fails its tasks later.
                    kill_worker(slot.pool)
                    slot.pool = new_worker(self._kit, self.config.mp_context)
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
        counts, toks = submitted_samples(samples, tokens, self.model.num_moe_layers, self.model.num_experts)
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

    def seal(self, layout: SampleLayout | None = None) -> int:
        """Close the open batch and start planning it. Returns its batch index (0, 1, ...).

        ``layout``: where each sample runs, in sample-id order (one batch: ``mb_batch`` all 0), instead of
        ``config.layout``; for a trainer whose micro-batching fixes it (verl's static micro-batches hold a
        fixed number of samples per GPU, :mod:`relibra.integrations.verl`). Under the cost model's
        ``tp * cp > 1`` its ``sample_gpu`` names each sample's TP x CP group
        (:func:`relibra.control.assembly.given_layout`).
        """
        with self._lock:
            if not self._open:
                raise ValueError("seal() with no submitted samples; submit() the batch's samples first")
            counts = np.concatenate([c for c, _, _, _ in self._open])
            tokens = np.concatenate([t for _, t, _, _ in self._open])
            ids = np.concatenate([i for _, _, i, _ in self._open])
            if np.unique(ids).size != ids.size:
                raise ValueError("sample_ids repeat within the batch; every sample needs its own id")
            t_arrival = max(t for _, _, _, t in self._open)
            perm = np.argsort(ids, kind="stable")
            given = (
                None
                if layout is None
                else given_layout(
                    layout,
                    counts[perm],
                    self.cluster.num_gpus,
                    self.cost.parallel,
                    tokens[perm],
                    self.model.top_k,
                )
            )
            self._open, self._next_id = [], 0
            job = Job(
                batch=self._next_batch,
                counts=counts[perm],
                sample_tokens=tokens[perm],
                prev_home=self._placement.copy(),
                t_arrival=t_arrival,
                seed=self.config.seed + self._next_batch,
                ctx_batch=self._next_batch,
                reorder_prev=self._placement.copy(),
                given=given,
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
        given = Assembled(
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
            job = Job(
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
                prev_redundant=ctx.prev_redundant,
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
            kill_worker(slot.pool)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ internals
    def _replace_worker(self, slot: Slot) -> None:
        """Kill ``slot``'s worker and start a fresh one (warmed in the background when configured)."""
        kill_worker(slot.pool)
        slot.pool = new_worker(self._kit, self.config.mp_context)
        slot.generation += 1
        slot.task = None
        if self.config.warm_up:
            # NOTE: queued ahead of the worker's next task; a failure there fails that task, not this call.
            self._warm_futures = [f for f in self._warm_futures if not f.done()]
            self._warm_futures.append(slot.pool.submit(warm_worker))

    def _start(self, job: Job) -> int:
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

    def _assemble(self, job: Job) -> Assembled:
        """Stage 1: layout and loads of ``job`` (or the ones it was given)."""
        if job.given is not None:
            return job.given
        return assemble_batch(
            job.counts, job.sample_tokens, self.cluster.num_gpus, self.config, self.model, self.cost.parallel
        )

    def _push(self, task: Task) -> None:
        heapq.heappush(self._ready, (task.key(), next(self._tiebreak), task))

    def _enqueue_first(self, job: Job, asm: Assembled) -> None:
        if job.delivered:
            return
        job.start(asm, self.replica_slots, self.cluster.num_gpus, self.per_layer and self._kit.locality)
        if job.locality_pending:
            job.locality = LocalityStatus.NOT_READY
        num_layers = job.prev_home.shape[0]
        if self.per_layer:
            for layer in range(num_layers):
                part = job.part(slice(layer, layer + 1), "reorder", self._kit.staged)
                self._push(Task(job.batch, layer, "reorder", reorder_task, part))
        else:
            self._push(
                Task(job.batch, 0, "batch", plan_task, job.part(slice(None), "batch", self._kit.staged))
            )

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

    def _on_done(self, index: int, generation: int, task: Task) -> Callable[[Future[Any]], None]:
        def callback(fut: Future[Any]) -> None:
            self._events.put(("done", index, generation, task, fut))

        return callback

    def _finish(self, index: int, generation: int, task: Task, fut: Future[Any]) -> None:
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

    def _placed(self, job: Job, layer: int) -> None:
        """Layer ``layer``'s placement is in (lock held): replicate it, or, when a locality round is due,
        start that round once every layer is placed."""
        assert job.placed is not None and job.home is not None
        job.placed[layer] = True
        if not job.locality_pending:
            self._push_replicate(job, layer)
        elif job.placed.all():
            part = job.part(slice(None), "locality", self._kit.staged, home=job.home.copy())
            self._push(Task(job.batch, -1, "locality", locality_task, part))

    def _locality_end(self, job: Job, status: LocalityStatus) -> None:
        """The locality round ended with ``status`` (lock held): replicate every layer on ``job.load``."""
        job.locality = status
        job.locality_pending = False
        for layer in range(job.prev_home.shape[0]):
            self._push_replicate(job, layer)

    def _locality_fallback(self, job: Job, status: LocalityStatus, why: str) -> None:
        """Keep the input sample assignment (lock held); ``job.load`` is still the input loads."""
        job.errors.append(f"batch locality: {why}")
        self._locality_end(job, status)

    def _push_replicate(self, job: Job, layer: int) -> None:
        assert job.home is not None
        part = job.part(
            slice(layer, layer + 1), "replicate", self._kit.staged, home=job.home[layer : layer + 1].copy()
        )
        self._push(Task(job.batch, layer, "replicate", replicate_task, part))

    def _fail(self, job: Job, task: Task, why: str) -> None:
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

    def _deliver(self, job: Job, waited: float) -> BatchPlan:
        """Freeze ``job`` into a plan with fallbacks (lock held)."""
        job.delivered = True
        now = time.perf_counter()
        g = self.cluster.num_gpus
        if job.asm is None:
            # NOTE: the deadline came before assembly ended: assemble here (the plan needs the loads).
            job.start(self._assemble(job), self.replica_slots, g, self.per_layer and self._kit.locality)
            if job.locality_pending:
                job.locality = LocalityStatus.NOT_READY
        plan, job.report = freeze_plan(job, self.cluster, waited, now, self.cost.parallel.group)
        return plan
