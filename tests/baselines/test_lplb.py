"""LPLB+: topology edges, at most two copies, LP optimality against brute force, the IPM gap, invariants."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from baselines.eplb import history_weight
from baselines.lplb import (
    LplbPlanner,
    exact_split,
    ipm_split,
    lplb_placement,
    max_load,
    redundant_to_original,
    topology_edges,
)
from relibra.invariants import check_plan
from relibra.planners.protocols import home_assign
from tests.builders import make_ctx


# ------------------------------------------------------------------------------------ topologies
def test_ring_edges() -> None:
    r2o = redundant_to_original("ring", 2, 4)
    assert topology_edges(r2o) == {((i - 1) % 8, i) for i in range(8)}


def test_hypercube_edges() -> None:
    r2o = redundant_to_original("hypercube", 2, 16)
    want = {(b * 16 + (i ^ (1 << j)), b * 16 + i) for b in range(2) for i in range(16) for j in range(4)}
    assert topology_edges(r2o) == want
    assert len(want) == 2 * 16 * 4


def test_cube_is_lplb_readme_matrix() -> None:
    r2o = redundant_to_original("cube", 1, 8)
    np.testing.assert_array_equal(r2o.T, [[3, 0, 1, 2, 7, 4, 5, 6], [6, 7, 4, 5, 0, 1, 2, 3]])
    edges = topology_edges(redundant_to_original("cube", 2, 8))
    assert all(o // 8 == c // 8 for o, c in edges)  # blocks of 8 stay independent


def test_torus_edges() -> None:
    nodes, gpn = 3, 4
    r2o = redundant_to_original("torus", nodes, gpn)
    want = set()
    for n, r in itertools.product(range(nodes), range(gpn)):
        want.add((n * gpn + (r - 1) % gpn, n * gpn + r))  # neighbour GPU of the same node
        want.add((((n - 1) % nodes) * gpn + r, n * gpn + r))  # same rail of the neighbour node
    assert topology_edges(r2o) == want


@pytest.mark.parametrize(
    ("topology", "nodes", "gpn"), [("ring", 1, 4), ("cube", 1, 8), ("hypercube", 1, 16), ("torus", 2, 4)]
)
def test_every_column_is_a_permutation_without_self_loops(topology: str, nodes: int, gpn: int) -> None:
    r2o = redundant_to_original(topology, nodes, gpn)
    for j in range(r2o.shape[1]):
        assert sorted(r2o[:, j]) == list(range(nodes * gpn))
    assert (r2o != np.arange(nodes * gpn)[:, None]).all()


@pytest.mark.parametrize(
    ("topology", "nodes", "gpn"), [("cube", 1, 4), ("hypercube", 1, 8), ("torus", 1, 8), ("mesh", 1, 8)]
)
def test_bad_topology_is_refused(topology: str, nodes: int, gpn: int) -> None:
    with pytest.raises(ValueError, match="topology"):
        redundant_to_original(topology, nodes, gpn)


@pytest.mark.parametrize("topology", ["ring", "cube", "torus"])
def test_at_most_two_copies_and_hottest_replicated(topology: str) -> None:
    rng = np.random.default_rng(0)
    weight = rng.random((4, 32))
    r2o = redundant_to_original(topology, 2, 4) if topology != "cube" else redundant_to_original("cube", 1, 8)
    placement = lplb_placement(weight, r2o, 2, 2 if topology != "cube" else 1)
    for l in range(4):
        copies = np.bincount(placement.redundant[l].ravel(), minlength=32)
        assert copies.max() <= 1  # one redundant copy at most -> two copies in all
        for p, e in enumerate(placement.edge_expert[l]):
            assert placement.home[l, e] == placement.orig_gpu[p]  # each edge starts at the original
            assert placement.copy_gpu[p] != placement.orig_gpu[p]
        # each GPU's two heaviest experts are the ones copied
        for g in range(8):
            mine = np.flatnonzero(placement.home[l] == g)
            hot = set(mine[np.argsort(-weight[l, mine])[:2]])
            assert hot == set(placement.edge_expert[l][placement.orig_gpu == g])


# ------------------------------------------------------------------------------------ the LP
def test_lp_matches_brute_force_on_tiny_cases() -> None:
    """Min-max split with integer data: the integer optimum is ceil(LP optimum) (max-flow integrality)."""
    rng = np.random.default_rng(1)
    r2o = redundant_to_original("ring", 1, 4)
    orig, copy = r2o[:, 0], np.arange(4)
    for _ in range(15):
        base = rng.integers(0, 12, size=(1, 4)).astype(np.float64)
        cap = np.minimum(rng.integers(0, 5, size=(1, 4)), base[0, orig]).astype(np.float64)
        flow, t = exact_split(base, cap, orig, copy)
        best = min(
            max_load(base, np.array([f], dtype=np.float64), orig, copy)[0]
            for f in itertools.product(*[range(int(c) + 1) for c in cap[0]])
        )
        assert max_load(base, flow, orig, copy)[0] == pytest.approx(t[0])
        assert t[0] <= best + 1e-9
        assert best == np.ceil(t[0] - 1e-9)
        assert ((flow >= 0) & (flow <= cap + 1e-9)).all()


def test_ipm_gap_is_nonnegative_and_vanishes() -> None:
    rng = np.random.default_rng(2)
    r2o = redundant_to_original("cube", 1, 8)
    orig, copy = r2o.ravel(), np.repeat(np.arange(8), 2)
    base = rng.integers(0, 1000, size=(40, 8)).astype(np.float64)
    cap = rng.integers(0, 300, size=(40, 16)).astype(np.float64)
    _, t = exact_split(base, cap, orig, copy)
    gaps = []
    for iters in (1, 3, 20):
        flow = ipm_split(base, cap, orig, copy, iters)
        assert ((flow >= 0) & (flow <= cap)).all()
        gaps.append((max_load(base, flow, orig, copy) - t) / t)
    assert all((g >= -1e-9).all() for g in gaps)
    assert gaps[0].mean() > gaps[2].mean()
    assert gaps[2].max() < 1e-6


# ------------------------------------------------------------------------------------ planner
@pytest.mark.parametrize(
    ("topology", "nodes", "gpn", "slots"),
    [("ring", 2, 4, 2), ("cube", 1, 8, 2), ("torus", 2, 4, 2), ("hypercube", 1, 16, 4)],
)
@pytest.mark.parametrize("solver", ["highs", "ipm"])
def test_plan_invariants(topology: str, nodes: int, gpn: int, slots: int, solver: str) -> None:
    ctx = make_ctx(nodes=nodes, gpus_per_node=gpn, num_experts=4 * nodes * gpn, history=2)
    planner = LplbPlanner(topology=topology, redundant_slots=slots, solver=solver)  # type: ignore[arg-type]
    plan = planner.plan(ctx)
    check_plan(plan, ctx, replica_slots=0, redundant_slots=slots, replicas_in_home_node=False)
    no_split = home_assign(ctx.load, plan.home, ctx.num_gpus).sum(2).max(-1)
    got = plan.assign.sum(2).max(-1)  # [Mb, L]
    assert (got <= no_split).all()
    if solver == "ipm":
        assert plan.stats["lp_gap_max"] >= -1e-9
    assert plan.stats["redundant_experts_per_gpu"] == ctx.load.shape[1] * slots


def test_history_mode_places_from_history() -> None:
    a = make_ctx(seed=3, history=3)
    plan = LplbPlanner(load_mode="history").plan(a)
    oracle = LplbPlanner(load_mode="oracle").plan(a)
    check_plan(plan, a, replica_slots=0, redundant_slots=2, replicas_in_home_node=False)
    assert not np.array_equal(plan.home, oracle.home)
    r2o = redundant_to_original("torus", 2, 4)
    want = lplb_placement(history_weight(a.history, 10, a.load.shape[1::2]), r2o, 2, 2)
    np.testing.assert_array_equal(plan.home, want.home)
    np.testing.assert_array_equal(plan.redundant, want.redundant)


def test_rejects_bad_slots() -> None:
    ctx = make_ctx(nodes=1, gpus_per_node=8, num_experts=16)
    with pytest.raises(ValueError, match="redundant_slots=3"):
        LplbPlanner(topology="cube", redundant_slots=3).plan(ctx)
    with pytest.raises(ValueError, match="solver"):
        LplbPlanner(solver="simplex")  # type: ignore[arg-type]


def test_cluster_problems_name_what_plan_would_refuse() -> None:
    """DeepSeek-V3 at EP 256 has one expert per GPU: two redundant slots cannot each copy one of them."""
    from relibra.cluster import ClusterSpec
    from tests.builders import HOPPER

    ep256 = ClusterSpec(nodes=32, gpus_per_node=8, hardware=HOPPER)
    (problem,) = LplbPlanner().cluster_problems(256, ep256)
    assert "planner.redundant_slots=2" in problem and "256 / 256 = 1" in problem
    assert LplbPlanner(redundant_slots=0).cluster_problems(256, ep256) == []
    assert LplbPlanner().cluster_problems(256, ClusterSpec(nodes=4, gpus_per_node=8, hardware=HOPPER)) == []
    (ring,) = LplbPlanner(topology="cube").cluster_problems(
        8, ClusterSpec(nodes=1, gpus_per_node=4, hardware=HOPPER)
    )
    assert "planner.topology=cube" in ring


def test_config_check_refuses_lplb_at_deepseek_v3_ep256() -> None:
    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError
    from tests.builders import cfg

    with pytest.raises(ConfigError, match=r"planner\.redundant_slots=2 must be a multiple"):
        check_config(
            cfg("model=deepseek-v3", "cluster.nodes=32", "planner=lplb", "simulator.memory_check=off")
        )
