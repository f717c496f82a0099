"""The incremental, migration-aware reordering and the recommended configuration built on it
(``planner=relibra_portfolio``; docs/reorder.md, "Incremental reordering")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hydra.utils import instantiate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec
from relibra.cost.migration import MigrationPayload
from relibra.cost.model import CostModel
from relibra.cost.pricing import predict_batch_time
from relibra.planners.compose import relibra, relibra_replicate_only
from relibra.planners.protocols import BatchContext, static_placement
from relibra.planners.reorder.anneal import solve_layer
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.reorder.kernels import placement_objective
from relibra.planners.reorder.links import link_routes
from relibra.planners.reorder.problem import layer_problem
from relibra.simulator import SimOptions, batch_context, simulate
from tests.builders import HOPPER, cfg, layer_ctx, tiny_setup

FAST = {"iterations": 150, "aggregate_warmup": 100, "seeds": (0, 1), "workers": 1}
INCREMENTAL = AnnealConfig(**FAST, start="previous", horizon=4.0)
H2D = 53.6e9


def _with_cost(ctx: BatchContext, dispatcher: str, overlap: bool, path: str = "network") -> BatchContext:
    cluster = replace(ctx.cluster, dispatcher=dispatcher, ep_overlap=overlap)
    pay = MigrationPayload(path=path, host_to_device_bytes_per_s=H2D)
    return replace(ctx, cluster=cluster, cost=CostModel(cluster, ctx.model, migration=pay))


def _recommended() -> object:
    """``planner=relibra_portfolio`` as composed (fewer annealing proposals, to keep the test fast)."""
    over = [f"planner.candidates.{c}.reorder.{k}={v}" for c in ("balance", "spread") for k, v in
            (("iterations", 150), ("aggregate_warmup", 100), ("locality_iterations", 2))]  # fmt: skip
    return instantiate(cfg("planner=relibra_portfolio", *over).planner, _convert_="all")


RECOMMENDED = _recommended()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    dispatcher=st.sampled_from(["alltoall", "deepep"]),
    overlap=st.booleans(),
    path=st.sampled_from(["network", "reload"]),
    alpha=st.sampled_from([0.1, 0.3, 1.0]),
)
def test_the_chosen_plan_never_predicts_a_batch_slower_than_keeping_the_placement(
    seed: int, dispatcher: str, overlap: bool, path: str, alpha: float
) -> None:
    rng = np.random.default_rng(seed)
    prev = np.stack([rng.permutation(np.repeat(np.arange(8), 2)) for _ in range(2)]).astype(np.int32)
    base = layer_ctx(2, 4, 16, microbatches=3, seed=seed, alpha=alpha, prev_home=prev)
    ctx = _with_cost(base, dispatcher, overlap, path)
    keep = relibra_replicate_only(replica_slots=2, placement="previous", name="relibra_keep_placement")
    kept = predict_batch_time(keep.plan(ctx), ctx)
    chosen = RECOMMENDED.plan(ctx)  # type: ignore[attr-defined]
    assert predict_batch_time(chosen, ctx) <= kept * (1 + 1e-12)
    # The incremental reorderer alone: each layer's objective (migration included) never above keeping it.
    routes = link_routes(2, 4)
    for l in range(2):
        home, obj, start = solve_layer(ctx.load[:, l], ctx.cost, INCREMENTAL, prev_home=prev[l], layer=l,
                                       routes=routes, attention=np.zeros(3), microbatches=3)  # fmt: skip
        problem = layer_problem(ctx.load[:, l], ctx.cost, prev_home=prev[l], migration_weight=0.25,
                                attention=np.zeros(3), microbatches=3)  # fmt: skip
        keep_obj = placement_objective(problem, prev[l], ctx.cluster, routes)
        assert start == pytest.approx(keep_obj, rel=1e-12)
        assert obj <= keep_obj * (1 + 1e-12)
        assert placement_objective(problem, home, ctx.cluster, routes) == pytest.approx(obj, rel=1e-9)


def test_a_layer_whose_moves_do_not_pay_keeps_its_placement() -> None:
    rng = np.random.default_rng(3)
    prev = np.stack([rng.permutation(np.repeat(np.arange(8), 4)) for _ in range(2)]).astype(np.int32)
    ctx = layer_ctx(2, 4, 32, seed=6, alpha=0.2, prev_home=prev)
    free = AnnealConfig(**FAST)
    moved = relibra(replica_slots=2, reorder=free).reorderer.reorder(ctx)  # type: ignore[attr-defined]
    assert moved.stats["reorder_kept_layers"] == 0
    # A horizon of a millionth of a batch: no move can pay, every layer keeps its placement.
    tight = AnnealConfig(**FAST, start="previous", horizon=1e-6)
    kept = relibra(replica_slots=2, reorder=tight).reorderer.reorder(ctx)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(kept.home, prev)
    assert kept.stats["reorder_kept_layers"] == 2 and kept.stats["reorder_moved_experts"] == 0
    # A long horizon lets the incremental search move where it pays, from the placement in force.
    loose = AnnealConfig(**FAST, start="previous", horizon=1e6)
    some = relibra(replica_slots=2, reorder=loose).reorderer.reorder(ctx)  # type: ignore[attr-defined]
    assert some.stats["reorder_moved_experts"] > 0


def test_first_batch_starts_from_the_static_placement() -> None:
    ctx = layer_ctx(2, 4, 32, seed=6, alpha=0.2)
    tight = AnnealConfig(**FAST, start="previous", horizon=1e-6)
    plan = relibra(replica_slots=2, reorder=tight).plan(ctx)
    np.testing.assert_array_equal(plan.home, static_placement(2, 32, 8))


@pytest.mark.parametrize("planner", ["relibra", "relibra_portfolio"])
def test_moved_experts_are_the_diff_of_home_against_prev_home_after_relabelling(planner: str) -> None:
    counts, workload, cluster, model, cost = tiny_setup(nodes=2, gpus_per_node=4, num_experts=16)
    over = (
        []
        if planner == "relibra"
        else [f"planner.candidates.{c}.reorder.horizon=1000.0" for c in ("balance",)]
    )
    built = instantiate(cfg(f"planner={planner}", *over).planner, _convert_="all")
    res = simulate(built, counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
    prev = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    for b, plan in enumerate(res.plans):
        diff = plan.home != prev
        assert res.moved[b] == np.count_nonzero(diff)
        assert plan.stats["reorder_moved_experts"] == np.count_nonzero(diff)
        np.testing.assert_array_equal(res.kept[b], ~diff.any(axis=1))
        expert_bytes = model.expert_params * cost.migration.bytes_per_param
        assert res.migration_bytes[b] == pytest.approx(np.count_nonzero(diff) * expert_bytes)
        prev = plan.home
    assert res.metrics["reorder_moved_experts"] == pytest.approx(res.moved.mean())
    assert res.metrics["layers_kept_share"] == pytest.approx(res.kept.mean())
    assert res.metrics["layers_kept_share_min"] == pytest.approx(res.kept.mean(axis=0).min())


def test_the_annealer_prices_moves_with_the_simulators_payload() -> None:
    """One place: the annealer's migration term follows ``cost.migration`` (payload and path)."""
    ctx = layer_ctx(2, 4, 16, seed=1)
    prev = np.repeat(np.arange(8), 2)
    heavy = _with_cost(ctx, "alltoall", False)
    light = replace(heavy, cost=CostModel(heavy.cluster, heavy.model, migration=MigrationPayload(
        expert_data_parallel=8)))  # fmt: skip
    a = layer_problem(ctx.load[:, 0], heavy.cost, prev_home=prev, migration_weight=1.0).mig
    b = layer_problem(ctx.load[:, 0], light.cost, prev_home=prev, migration_weight=1.0).mig
    np.testing.assert_allclose(b, a * 3.5 / 14.0)
    reload = _with_cost(ctx, "alltoall", False, path="reload")
    c = layer_problem(ctx.load[:, 0], reload.cost, prev_home=prev, migration_weight=1.0).mig
    same_node = (prev[:, None] // 4) == (np.arange(8)[None, :] // 4)
    assert (c[same_node] == 0).all() and (c[~same_node] >= a[~same_node]).all() and (c[~same_node] > 0).all()


def test_portfolio_picks_keep_when_migration_is_expensive_under_reload_too() -> None:
    counts, workload, _, model, _ = tiny_setup(nodes=2, gpus_per_node=4, num_experts=16)
    slow = replace(HOPPER, host_to_device_bytes_per_s=1.0)  # one byte per second: any cross-node move loses
    cl = ClusterSpec(2, 4, slow)
    cost = CostModel(cl, model, migration=MigrationPayload(path="reload", host_to_device_bytes_per_s=1.0))
    ctx = batch_context(counts, workload, 0, cl, model, cost)
    plan = RECOMMENDED.plan(ctx)  # type: ignore[attr-defined]
    gpn = cl.gpus_per_node
    static = static_placement(counts.num_layers, counts.num_experts, cl.num_gpus)
    assert ((plan.home // gpn) == (static // gpn)).all()  # nothing crossed a node
