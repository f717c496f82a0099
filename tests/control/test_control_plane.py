"""The control plane: same plans as the serial planner (locality round included), arrival order, deadline
fallbacks (per layer and for the locality round), worker failure."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from relibra.cluster import ClusterSpec
from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.control.report import Fallback, LocalityStatus
from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours
from relibra.invariants import check_plan
from relibra.planners.compose import StaticReorderer, relibra, relibra_replicate_only
from relibra.planners.protocols import (
    BatchContext,
    Reordering,
    Replication,
    StagedReorderer,
    static_placement,
)
from relibra.planners.reorder.anneal import AnnealingReorderer
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyReplicator
from relibra.simulator import batch_context
from relibra.workload import build_workload
from tests.builders import HOPPER, random_counts, tiny_model

LAYERS = 4
SLOTS = 2


def _setup(num_samples: int = 24, seed: int = 0):
    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=HOPPER)
    model = tiny_model(num_experts=8, num_layers=LAYERS)
    counts = random_counts(
        num_samples=num_samples, num_layers=LAYERS, num_experts=8, num_batches=1, seed=seed
    )
    return counts, cluster, model, CostModel(cluster, model)


def _ctx(counts, cluster, model, cost, spm: int = 2) -> BatchContext:
    workload = build_workload(counts, cluster.num_gpus, samples_per_microbatch=spm)
    return batch_context(counts, workload, 0, cluster, model, cost)


def _check(plan, ctx):
    check_plan(plan, ctx, replica_slots=SLOTS)


@dataclass(frozen=True)
class SlowReorderer:
    """Static placement, but layers (of ``samples`` samples) whose expert-0 total is in ``slow`` take
    ``seconds`` first."""

    slow: tuple[int, ...]
    seconds: float
    samples: int = 24

    def reorder(self, ctx: BatchContext) -> Reordering:
        counts = np.asarray(ctx.counts)
        if counts.shape[0] == self.samples and int(counts[..., 0].sum()) in self.slow:
            time.sleep(self.seconds)
        return StaticReorderer().reorder(ctx)


@dataclass(frozen=True)
class CrashingReorderer:
    """Kills its worker process on the layer whose expert-0 total is ``target``; only the first time when
    ``marker`` names a file to create, every time when it is empty."""

    target: int
    marker: str = ""

    def reorder(self, ctx: BatchContext) -> Reordering:
        if int(np.asarray(ctx.counts)[..., 0].sum()) == self.target:
            if not self.marker or not Path(self.marker).exists():
                if self.marker:
                    Path(self.marker).touch()
                os._exit(13)
        return StaticReorderer().reorder(ctx)


@dataclass(frozen=True)
class FailingReplicator:
    """Raises on the layer whose expert-0 total is ``target``; the greedy elsewhere."""

    target: int
    replica_slots: int = SLOTS
    refill_aware: bool = False

    def with_slots(self, replica_slots: int) -> FailingReplicator:
        return replace(self, replica_slots=replica_slots)

    def replicate(
        self, load: np.ndarray, home: np.ndarray, ctx: BatchContext, overlap: OverlapNeighbours | None = None
    ) -> Replication:
        if int(np.asarray(ctx.counts)[..., 0].sum()) == self.target:
            raise RuntimeError("replicator failed on purpose")
        return GreedyReplicator(replica_slots=SLOTS).replicate(load, home, ctx, overlap)


@dataclass(frozen=True)
class StuckLocality:
    """Static placement; its locality round sleeps ``seconds`` (``mode="sleep"``), raises (``"raise"``), or
    kills its worker (``"crash"``) before it would move every sample one GPU up."""

    mode: str
    seconds: float = 30.0

    @property
    def moves_samples(self) -> bool:
        return True

    def place(self, ctx: BatchContext, layers=None) -> Reordering:
        return StaticReorderer().reorder(ctx)

    def reorder(self, ctx: BatchContext) -> Reordering:
        home = self.place(ctx).home
        return Reordering(home=home, sample_gpu=self.locality_step(ctx, home)[0])

    def locality_step(self, ctx: BatchContext, home: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        if self.mode == "sleep":
            time.sleep(self.seconds)
        elif self.mode == "raise":
            raise RuntimeError("locality failed on purpose")
        elif self.mode == "crash":
            os._exit(13)
        return (np.asarray(ctx.sample_gpu) + 1) % ctx.num_gpus, {}


def _layer_key(counts, layer: int) -> int:
    keys = [int(counts.counts[:, l, 0].sum()) for l in range(LAYERS)]
    assert len(set(keys)) == LAYERS, "test fixture: layers must differ in expert-0 totals"
    return keys[layer]


RELIBRA = {"iterations": 50, "aggregate_warmup": 50, "locality": True}
"""ReLibra's reordering with its locality round (short annealing: the test is about equality, not quality)."""


def test_relibra_with_locality_equals_the_serial_planner_for_any_worker_count():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    serial = relibra(replica_slots=SLOTS, reorder=AnnealConfig(**RELIBRA)).plan(ctx)
    assert np.count_nonzero(serial.sample_gpu != ctx.sample_gpu) > 0, "fixture: the locality round must move"
    for workers in (0, 2):
        with ControlPlane.from_planner(
            relibra(replica_slots=SLOTS, reorder=AnnealConfig(**RELIBRA)),
            cluster,
            model,
            cost,
            ControlPlaneConfig(workers=workers),
        ) as cp:
            assert isinstance(cp._kit.reorderer, StagedReorderer) and cp._kit.locality
            plan = cp.plan(ctx)
            report = cp.report(0)
        _check(plan, ctx)
        assert not report.fallback.any() and report.locality is LocalityStatus.DONE
        assert report.time_to_all_plans_s >= report.time_to_first_plan_s > 0 and report.locality_s > 0
        for field in ("home", "sample_gpu", "load", "assign", "replicas"):
            np.testing.assert_array_equal(getattr(plan, field), getattr(serial, field), err_msg=field)
        for key in ("locality_moved_samples", "locality_comm_after_s", "reorder_objective_s"):
            assert plan.stats[key] == pytest.approx(serial.stats[key]), key


def test_place_then_locality_step_is_reorder():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    reorderer = AnnealingReorderer(AnnealConfig(**RELIBRA))
    whole = reorderer.reorder(ctx)
    rows = [
        reorderer.place(
            BatchContext(**{**ctx.__dict__, "counts": ctx.counts[:, [l]], "load": ctx.load[:, [l]]}),
            layers=(l,),
        ).home[0]
        for l in range(LAYERS)
    ]
    np.testing.assert_array_equal(np.stack(rows), whole.home)
    sample_gpu, _ = reorderer.locality_step(ctx, whole.home)
    np.testing.assert_array_equal(sample_gpu, whole.sample_gpu)


def test_replicate_only_through_the_control_plane_equals_the_serial_planner():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    serial = relibra_replicate_only(replica_slots=SLOTS).plan(ctx)
    with ControlPlane.from_planner(
        relibra_replicate_only(replica_slots=SLOTS), cluster, model, cost, ControlPlaneConfig(workers=0)
    ) as cp:
        through = cp.plan(ctx)
        assert cp.report(0).locality is LocalityStatus.OFF
    for field in ("home", "assign", "replicas", "load"):
        np.testing.assert_array_equal(getattr(through, field), getattr(serial, field))


def test_arrival_order_does_not_change_the_plan():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    rng = np.random.default_rng(3)
    order = rng.permutation(counts.num_samples)
    cfg = ControlPlaneConfig(workers=0, samples_per_microbatch=2)
    with ControlPlane.from_planner(
        relibra_replicate_only(replica_slots=SLOTS), cluster, model, cost, cfg
    ) as cp:
        for chunk in np.array_split(order, 5):
            cp.submit(counts.counts[chunk], counts.tokens[chunk], sample_ids=chunk)
        batch = cp.seal()
        plan = cp.plans(batch)
        # A second batch in arrival order: its fallback placement is the first batch's delivered one.
        cp.submit(counts.counts, counts.tokens)
        second = cp.plans(cp.seal(), deadline_s=0.0)
    _check(plan, ctx)  # same layout as the simulator's in-order workload
    np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)
    np.testing.assert_array_equal(plan.load, ctx.load)
    assert batch == 0 and second.home.shape == plan.home.shape


def test_deadline_falls_back_without_blocking():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    slow = (_layer_key(counts, 2), _layer_key(counts, 3))
    cp = ControlPlane(
        cluster,
        model,
        cost,
        reorderer=SlowReorderer(slow=slow, seconds=30.0),
        replicator=GreedyReplicator(replica_slots=SLOTS),
        replica_slots=SLOTS,
        name="slow",
        config=ControlPlaneConfig(workers=2, samples_per_microbatch=2),
    )
    try:
        cp.submit(counts.counts, counts.tokens)
        batch = cp.seal()
        deadline = 2.0
        t0 = time.perf_counter()
        plan = cp.plans(batch, deadline_s=deadline)
        waited = time.perf_counter() - t0
        report = cp.report(batch)
    finally:
        t_close = time.perf_counter()
        cp.close()
        closed_in = time.perf_counter() - t_close
    assert waited < deadline + 1.0 and closed_in < 10.0  # a stuck worker is terminated, not awaited
    _check(plan, ctx)
    flags = report.fallback
    assert flags[2] == flags[3] == Fallback.PREVIOUS_PLACEMENT | Fallback.NO_REPLICATION
    assert not flags[:2].any()
    static = static_placement(LAYERS, 8, cluster.num_gpus)
    np.testing.assert_array_equal(plan.home[2:], static[2:])
    assert plan.replicas is not None and (plan.replicas[:, 2:] == -1).all()
    assert np.isnan(report.time_to_all_plans_s) and report.previous_placement_layers == 2
    assert plan.stats["cp_previous_placement_layers"] == 2.0


def test_zero_deadline_delivers_the_previous_placement():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    with ControlPlane(
        cluster,
        model,
        cost,
        reorderer=SlowReorderer(slow=tuple(_layer_key(counts, l) for l in range(LAYERS)), seconds=0.5),
        replicator=GreedyReplicator(replica_slots=SLOTS),
        replica_slots=SLOTS,
        config=ControlPlaneConfig(workers=0, samples_per_microbatch=2),
    ) as cp:
        cp.submit(counts.counts, counts.tokens)
        plan = cp.plans(cp.seal(), deadline_s=0.0)
        report = cp.report(0)
    _check(plan, ctx)
    assert (report.fallback & Fallback.PREVIOUS_PLACEMENT).all()
    np.testing.assert_array_equal(plan.home, static_placement(LAYERS, 8, cluster.num_gpus))


def test_crashed_worker_is_replaced_and_its_layer_replanned(tmp_path):
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    crash = CrashingReorderer(target=_layer_key(counts, 1), marker=str(tmp_path / "crashed"))
    with ControlPlane(
        cluster,
        model,
        cost,
        reorderer=crash,
        replicator=GreedyReplicator(replica_slots=SLOTS),
        replica_slots=SLOTS,
        config=ControlPlaneConfig(workers=1, max_retries=1, warm_up=False),
    ) as cp:
        plan = cp.plan(ctx)
        report = cp.report(0)
    _check(plan, ctx)
    assert (tmp_path / "crashed").exists()
    assert report.worker_crashes == 1 and report.retries == 1 and not report.fallback.any()


def test_always_crashing_layer_falls_back_and_nothing_is_lost():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    with ControlPlane(
        cluster,
        model,
        cost,
        reorderer=CrashingReorderer(target=_layer_key(counts, 1)),
        replicator=FailingReplicator(target=_layer_key(counts, 3)),
        replica_slots=SLOTS,
        config=ControlPlaneConfig(workers=1, max_retries=1, warm_up=False),
    ) as cp:
        plan = cp.plan(ctx)
        report = cp.report(0)
    _check(plan, ctx)
    # Layer 1: reordering died twice -> previous placement, still replicated; layer 3: replication raised.
    assert report.fallback.tolist() == [0, Fallback.PREVIOUS_PLACEMENT, 0, Fallback.NO_REPLICATION]
    assert report.worker_crashes == 2 and report.retries == 1 and len(report.errors) == 2
    assert "replicator failed on purpose" in " ".join(report.errors)
    assert np.isfinite(report.time_to_all_plans_s)


def _locality_plane(cluster, model, cost, mode: str, seconds: float = 30.0, **config) -> ControlPlane:
    # NOTE: no warm-up, which would run the stuck locality round in every new worker.
    config.setdefault("warm_up", False)
    return ControlPlane(
        cluster,
        model,
        cost,
        reorderer=StuckLocality(mode, seconds),
        replicator=GreedyReplicator(replica_slots=SLOTS),
        replica_slots=SLOTS,
        config=ControlPlaneConfig(**config),
    )


def _assert_input_samples_replicated(plan, report, ctx, status: LocalityStatus) -> None:
    _check(plan, ctx)
    assert report.locality is status and report.locality_fallback
    assert plan.stats["cp_locality_fallback"] == 1.0
    np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)
    np.testing.assert_array_equal(plan.load, ctx.load)
    # Every layer is placed and replicated, on the input loads.
    assert not report.fallback.any() and np.isfinite(report.time_to_all_plans_s)
    assert any("locality" in e for e in report.errors)


def test_locality_round_past_its_deadline_keeps_the_input_samples():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    # NOTE: a round of 120 s against a bound of 60 s: the wait is the 1 s deadline plus replacing the worker
    # and replicating in the new one, which took 11.4 s on a loaded 2-core machine (the bound was 10 s then).
    cp = _locality_plane(cluster, model, cost, "sleep", 120.0, workers=2, locality_deadline_s=1.0)
    try:
        t0 = time.perf_counter()
        plan = cp.plan(ctx)  # no plans() deadline: only the locality round's own limit ends the wait
        waited = time.perf_counter() - t0
        report = cp.report(0)
    finally:
        cp.close()
    assert waited < 60.0  # not the 120 s the round would take: its worker was replaced
    _assert_input_samples_replicated(plan, report, ctx, LocalityStatus.TIMED_OUT)


def test_failed_or_crashing_locality_round_keeps_the_input_samples():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    with _locality_plane(cluster, model, cost, "raise", workers=0) as cp:
        plan = cp.plan(ctx)
        _assert_input_samples_replicated(plan, cp.report(0), ctx, LocalityStatus.FAILED)
        assert "locality failed on purpose" in " ".join(cp.report(0).errors)
    with _locality_plane(cluster, model, cost, "crash", workers=1, max_retries=1) as cp:
        plan = cp.plan(ctx)
        report = cp.report(0)
    _assert_input_samples_replicated(plan, report, ctx, LocalityStatus.FAILED)
    assert report.worker_crashes == 2 and report.retries == 1


def test_plans_deadline_before_the_locality_round_delivers_input_samples():
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    with _locality_plane(cluster, model, cost, "sleep", workers=0, samples_per_microbatch=2) as cp:
        cp.submit(counts.counts, counts.tokens)
        plan = cp.plans(cp.seal(), deadline_s=0.0)
        report = cp.report(0)
    _check(plan, ctx)
    assert report.locality is LocalityStatus.NOT_READY and report.locality_fallback
    np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)


def test_whole_batch_planner_runs_as_one_task():
    eplb = pytest.importorskip("baselines.eplb")
    counts, cluster, model, cost = _setup()
    ctx = _ctx(counts, cluster, model, cost)
    planner = eplb.EplbPlanner(redundant_slots=2)
    direct = planner.plan(ctx)
    with ControlPlane.from_planner(planner, cluster, model, cost, ControlPlaneConfig(workers=0)) as cp:
        through = cp.plan(ctx)
    for field in ("home", "assign", "load"):
        np.testing.assert_array_equal(getattr(through, field), getattr(direct, field))
    assert not cp.per_layer


def test_bad_calls_name_the_problem():
    counts, cluster, model, cost = _setup()
    with ControlPlane.from_planner(
        relibra_replicate_only(replica_slots=SLOTS), cluster, model, cost, ControlPlaneConfig(workers=0)
    ) as cp:
        with pytest.raises(ValueError, match="no submitted samples"):
            cp.seal()
        with pytest.raises(ValueError, match=r"\(L, E\)"):
            cp.submit(np.zeros((2, LAYERS + 1, 8), dtype=np.int32), np.ones(2, dtype=np.int64))
        with pytest.raises(KeyError, match="never sealed"):
            cp.plans(7)
        cp.submit(counts.counts[:4], counts.tokens[:4], sample_ids=np.array([0, 1, 1, 2]))
        with pytest.raises(ValueError, match="repeat"):
            cp.seal()
    with pytest.raises(ValueError, match="workers"):
        ControlPlaneConfig(workers=-1)


def test_relibra_under_overlap_through_the_control_plane_equals_the_serial_planner():
    """The control plane's per-layer tasks (placement slices, one replication task per layer with every
    micro-batch) give the plan the serial planner gives under the overlap."""
    counts, cluster, model, _ = _setup()
    cluster = replace(cluster, ep_overlap=True)
    cost = CostModel(cluster, model)
    ctx = _ctx(counts, cluster, model, cost)
    assert ctx.num_microbatches >= 2
    serial = relibra(replica_slots=SLOTS, reorder=AnnealConfig(**RELIBRA)).plan(ctx)
    assert "overlap_second_pass_share" in serial.stats
    with ControlPlane.from_planner(
        relibra(replica_slots=SLOTS, reorder=AnnealConfig(**RELIBRA)),
        cluster,
        model,
        cost,
        ControlPlaneConfig(workers=0),
    ) as cp:
        plan = cp.plan(ctx)
    for name in ("home", "sample_gpu", "load", "assign", "replicas"):
        np.testing.assert_array_equal(getattr(plan, name), getattr(serial, name), err_msg=name)
    assert plan.stats["reorder_objective_s"] == pytest.approx(serial.stats["reorder_objective_s"])
