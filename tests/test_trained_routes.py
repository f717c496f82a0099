"""Plans made on the replayed routes, priced on the trained ones (relibra.trained_routes, the simulator's
``trained`` seam, relibra.trace.mismatch)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from baselines.balanced import BalancedBound
from baselines.megatron import MegatronPlanner
from experiments.config.build import build_planner
from experiments.config.spec import build_spec
from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import BatchContext, SlotBudget
from relibra.planners.registry import names
from relibra.simulator import METRIC_COLUMNS, SimOptions, simulate
from relibra.trace.mismatch import trained_counts
from relibra.trained_routes import TrainedRoutes, plans_on_replay, split_like
from relibra.types import BatchPlan, OnlineCopies, SampleCounts
from relibra.workload import build_workload, microbatch_loads
from tests.builders import HOPPER, cfg, tiny_setup


def test_split_like_keeps_the_proportions_and_the_totals() -> None:
    rng = np.random.default_rng(0)
    assign = rng.integers(0, 5, size=(3, 2, 6, 4)) * (rng.random((3, 2, 6, 4)) < 0.5)
    assign[0, 0, 0] = 0  # an expert the planner saw no token of
    home = rng.integers(0, 4, size=(2, 6))
    total = rng.integers(0, 50, size=(3, 2, 6))
    out = split_like(assign, total, home)
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out.sum(axis=-1), total)
    seen = assign.sum(axis=-1) > 0
    assert not ((out > 0) & (assign == 0) & seen[..., None]).any()  # no copy the plan left empty
    assert out[0, 0, 0, home[0, 0]] == total[0, 0, 0]  # unseen: at home
    share = out / np.maximum(total, 1)[..., None]
    planned = assign / np.maximum(assign.sum(axis=-1), 1)[..., None]
    assert np.all(np.abs(share - planned)[seen] <= 1.0 / np.maximum(total, 1)[seen][..., None] + 1e-12)
    # the planned totals give the plan back exactly
    np.testing.assert_array_equal(split_like(assign, assign.sum(axis=-1), home), assign)


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(nodes=2, gpus_per_node=2, num_experts=8)


@pytest.mark.parametrize(
    "name", ["megatron", "relibra_replicate_only", "relibra", "eplb_history", "balanced"]
)
def test_trained_routes_equal_to_the_replayed_ones_change_nothing(setup, name) -> None:
    counts, workload, cluster, model, cost = setup
    planner = build_planner(build_spec(cfg(f"planner={name}")))
    alone = simulate(planner, counts, workload, cluster, model, cost)
    same = simulate(planner, counts, workload, cluster, model, cost, trained=TrainedRoutes(counts, workload))
    for column in METRIC_COLUMNS:
        if column != "plan_time_s":
            assert alone.metrics[column] == same.metrics[column], column
    np.testing.assert_array_equal(alone.skew, same.skew)


def test_trained_routes_of_other_samples_are_refused(setup) -> None:
    counts, workload, cluster, model, cost = setup
    other = replace(counts, tokens=counts.tokens + 1)
    with pytest.raises(ValueError, match=r"counts\.tokens"):
        simulate(
            MegatronPlanner(), counts, workload, cluster, model, cost, trained=TrainedRoutes(other, workload)
        )


@dataclass(frozen=True)
class OnlineToy:
    """Megatron's plan, marked as made after the step's routing (an online plan), under any name."""

    name: str
    slot_budget: SlotBudget = field(default_factory=SlotBudget)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        plan = MegatronPlanner().plan(ctx)
        return replace(plan, online=OnlineCopies(np.zeros(plan.assign.shape[:2]), 0, False))


def _trained(counts: SampleCounts, mismatch: float, num_gpus: int, spm: int) -> TrainedRoutes:
    trained = trained_counts(counts, mismatch, seed=0)
    return TrainedRoutes(trained, build_workload(trained, num_gpus, samples_per_microbatch=spm))


def test_who_plans_on_the_replay_is_the_registry_s_word() -> None:
    assert all(plans_on_replay(name) for name in names("replay"))
    assert not any(plans_on_replay(name) for name in names("online"))
    assert plans_on_replay("eplb") and plans_on_replay("lplb")
    assert not any(plans_on_replay(n) for n in ("megatron", "popfetcher", "eplb_history", "eplb_periodic"))
    with pytest.raises(KeyError, match="not registered"):
        plans_on_replay("no_such_planner")


@pytest.mark.parametrize("name", ["ultraep", "popfetcher", "eplb_history", "megatron"])
def test_a_planner_that_reads_no_replay_gets_the_trained_routes(setup, name) -> None:
    counts, workload, cluster, model, cost = setup
    trained = _trained(counts, 0.5, cluster.num_gpus, 2)
    assert not np.array_equal(trained.workload.load, workload.load)
    planner = build_planner(build_spec(cfg(f"planner={name}")))
    result = simulate(planner, counts, workload, cluster, model, cost, SimOptions(keep_plans=True), trained)
    for b, plan in enumerate(result.plans):  # the trained counts under the plan's own sample layout
        sl, mbs = counts.batch(b), workload.batch_microbatches(b)
        local = workload.sample_mb[sl] - int(mbs[0])
        expected = microbatch_loads(
            trained.counts.counts[sl], plan.sample_gpu, local, mbs.size, cluster.num_gpus
        )
        np.testing.assert_array_equal(plan.load, expected)


def test_an_online_plan_from_a_replay_planner_is_refused(setup) -> None:
    """A plan made after routing cannot have been made on the replayed routes it was handed."""
    counts, workload, cluster, model, cost = setup
    trained = _trained(counts, 0.5, cluster.num_gpus, 2)
    with pytest.raises(ValueError, match="routing replay"):
        simulate(OnlineToy("relibra"), counts, workload, cluster, model, cost, trained=trained)
    with pytest.raises(KeyError, match="not registered"):
        simulate(OnlineToy("toy"), counts, workload, cluster, model, cost, trained=trained)
    simulate(OnlineToy("toy"), counts, workload, cluster, model, cost)  # exact replay asks no card


def test_a_planner_before_the_step_sees_the_replayed_routes_and_is_priced_on_the_trained(setup) -> None:
    counts, workload, cluster, model, cost = setup
    trained = _trained(counts, 0.5, cluster.num_gpus, 2)
    planner = build_planner(build_spec(cfg("planner=relibra_replicate_only")))
    result = simulate(
        planner,
        counts,
        workload,
        cluster,
        model,
        cost,
        SimOptions(keep_plans=True, check_plans=True),
        trained,
    )
    plans = np.concatenate([p.load for p in result.plans])
    np.testing.assert_array_equal(plans, workload.load)  # the plans kept are the planner's, on the replay
    on_trained = simulate(MegatronPlanner(), counts, workload, cluster, model, cost, trained=trained)
    on_replay = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    assert on_trained.metrics["skew_mean"] != on_replay.metrics["skew_mean"]


def _microbatch_hotspots() -> tuple[SampleCounts, ClusterSpec, ModelSpec]:
    """Every micro-batch has its own hot expert (each of its tokens picks it), the rest uniform: the skew
    a replay-based replicator exploits per micro-batch, at Qwen3-30B-A3B's expert shape, EP 4."""
    g, num_experts, num_layers, k, t = 4, 16, 2, 2, 512
    cluster = ClusterSpec(nodes=1, gpus_per_node=g, hardware=HOPPER)
    model = ModelSpec(
        name="hotspots",
        num_layers=num_layers,
        num_moe_layers=num_layers,
        hidden=2048,
        moe_ffn=768,
        num_experts=num_experts,
        top_k=k,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
    )
    s = 2 * 8 * g
    tokens = np.full(s, t, dtype=np.int64)
    offsets = np.array([0, s // 2, s], dtype=np.int64)
    empty = SampleCounts(np.zeros((s, num_layers, num_experts), np.int32), tokens, offsets, k)
    sample_mb = build_workload(empty, g, samples_per_microbatch=1).sample_mb  # the layout reads tokens only
    rng = np.random.default_rng(0)
    c = np.zeros((s, num_layers, num_experts), dtype=np.int32)
    for i in range(s):
        hot = (3 * int(sample_mb[i])) % num_experts
        p = np.full(num_experts, 1.0 / (num_experts - 1))
        p[hot] = 0.0
        for layer in range(num_layers):
            c[i, layer] = rng.multinomial(t * (k - 1), p)
            c[i, layer, hot] = t
    return SampleCounts(c, tokens, offsets, k), cluster, model


def test_a_replay_based_planner_loses_its_edge_as_the_mismatch_grows() -> None:
    """ReLibra's replicator plans each micro-batch's copies on the replayed loads; as more of the trained
    slots are re-drawn from the batch's popularity, the copies serve experts that are no longer hot, while
    Megatron-LM's static placement gains from the flatter trained loads: its step time over ReLibra's (the
    edge) falls, below 1 once every slot is re-drawn."""
    counts, cluster, model = _microbatch_hotspots()
    cost = CostModel(cluster, model)
    workload = build_workload(counts, cluster.num_gpus, samples_per_microbatch=1)
    planner = build_planner(build_spec(cfg("planner=relibra_replicate_only")))
    edges = []
    for mismatch in (0.0, 0.5, 1.0):
        trained = None if mismatch == 0 else _trained(counts, mismatch, cluster.num_gpus, 1)
        times = [
            simulate(p, counts, workload, cluster, model, cost, trained=trained).metrics["step_time_s"]
            for p in (MegatronPlanner(), planner)
        ]
        edges.append(times[0] / times[1])
    assert edges[0] > 1.03, edges
    assert edges[0] > edges[1] > edges[2], edges
    assert edges[2] < 0.95, edges


def test_balanced_bounds_every_planner_on_the_trained_routes() -> None:
    counts, cluster, model = _microbatch_hotspots()
    cost = CostModel(cluster, model)
    workload = build_workload(counts, cluster.num_gpus, samples_per_microbatch=1)
    trained = _trained(counts, 0.5, cluster.num_gpus, 1)
    bound = simulate(BalancedBound(), counts, workload, cluster, model, cost, trained=trained)
    for planner in (MegatronPlanner(), build_planner(build_spec(cfg("planner=relibra_replicate_only")))):
        run = simulate(planner, counts, workload, cluster, model, cost, trained=trained)
        assert bound.metrics["step_time_s"] <= run.metrics["step_time_s"]


@pytest.mark.parametrize("name", ["eplb", "relibra", "relibra_portfolio"])
def test_plans_run_on_the_trained_routes_keep_every_invariant(setup, name) -> None:
    """Permanent copies (EPLB+), moved samples and replica slots (ReLibra): the plan as the step runs it on
    the trained routes passes the shared checker too (SimOptions.check_plans checks both)."""
    counts, workload, cluster, model, cost = setup
    trained = _trained(counts, 0.5, cluster.num_gpus, 2)
    planner = build_planner(build_spec(cfg(f"planner={name}")))
    simulate(planner, counts, workload, cluster, model, cost, SimOptions(check_plans=True), trained)
