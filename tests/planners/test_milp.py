"""The exact replication MILP and the LP split: brute force, routing, and the greedy against the optimum."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.invariants import check_assignment
from relibra.planners.protocols import static_placement
from relibra.planners.replicate.greedy import linear_objective, replicate_greedy
from relibra.planners.replicate.milp import (
    LINK_KEYS,
    MilpConfig,
    MilpReplicator,
    dispatch_routing,
    solve_replication,
    solve_split,
)
from tests.spine_helpers import HOPPER, tiny_context

MODEL = ModelSpec("test-moe", 2, 2, 2048, 768, 8, 2, 16, 4, 128)


def _cost(nodes: int, gpn: int) -> CostModel:
    return CostModel(ClusterSpec(nodes, gpn, HOPPER), MODEL)


def _loads(seed: int, g: int, e: int, tokens: int = 400) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(e, 0.6))
    return rng.multinomial(tokens * 2, p, size=g).astype(np.int32)  # [G, E]


@pytest.mark.parametrize(("nodes", "gpn"), [(1, 4), (2, 2)])
def test_routing_reproduces_link_bytes(nodes: int, gpn: int) -> None:
    cost = _cost(nodes, gpn)
    g = nodes * gpn
    traffic = np.random.default_rng(0).random((g, g))
    routing = dispatch_routing(cost)
    lb = cost.link_bytes(traffic)
    for c, key in enumerate(LINK_KEYS):
        np.testing.assert_allclose(np.einsum("ojg,jg->o", routing[c], traffic), lb[key], rtol=1e-12)


def test_milp_equals_best_lp_over_every_replica_set() -> None:
    """Brute force on a tiny node: the MILP's optimum is the best LP split over all feasible replica sets."""
    cost = _cost(1, 3)
    x = _loads(1, 3, 6)
    home = static_placement(1, 6, 3)[0]
    sol = solve_replication(x, home, cost, 1)
    assert sol.optimal
    cands = [(e, g) for e in range(6) for g in range(3) if g != home[e]]
    best = np.inf
    for picks in itertools.product([None, *range(len(cands))], repeat=3):  # one slot per GPU
        copies = np.arange(3) == home[:, None]
        ok = True
        for g, pick in enumerate(picks):
            if pick is None:
                continue
            e, gg = cands[pick]
            ok &= gg == g
            copies[e, gg] = True
        if ok:
            best = min(best, solve_split(x, home, cost, copies).objective_s)
    assert sol.objective_s == pytest.approx(best, rel=1e-6)
    assert sol.bound_s <= sol.objective_s + 1e-12


@pytest.mark.parametrize(
    ("nodes", "gpn", "seed", "heavy"), [(1, 4, 0, 1), (1, 4, 1, 1), (2, 2, 2, 1), (2, 4, 3, 1), (1, 8, 4, 6)]
)
def test_greedy_close_to_milp_on_small_cases(nodes: int, gpn: int, seed: int, heavy: int) -> None:
    """``heavy``: GPU 0 holds that many times the others' tokens (a communication-bound problem)."""
    cost = _cost(nodes, gpn)
    g = nodes * gpn
    x = _loads(seed, g, 16)
    x[0] *= heavy
    home = np.random.default_rng(seed).permutation(static_placement(1, 16, g)[0])
    sol = solve_replication(x, home, cost, 2, time_limit_s=20.0)
    rep = replicate_greedy(x, home, cost, 2)
    greedy = float(linear_objective(x, rep.assign, home, cost))
    milp = float(linear_objective(x, sol.assign, home, cost))
    assert milp == pytest.approx(sol.objective_s, rel=1e-6)  # the MILP's value is the linear objective
    assert greedy >= sol.bound_s * (1 - 1e-6)  # nothing beats the proven bound
    assert greedy <= sol.objective_s * 1.05  # the worst case
    # the MILP plan satisfies the replication invariants
    copies_out = sol.copies & (np.arange(g) != home[:, None])
    assert copies_out.sum(axis=0).max() <= 2
    same_node = (np.arange(g) // gpn) == (home[:, None] // gpn)
    assert not np.any(copies_out & ~same_node)
    np.testing.assert_allclose(sol.assign.sum(axis=1), x.sum(axis=0), rtol=1e-6)


def test_lp_split_no_worse_than_waterfill_for_same_replicas() -> None:
    cost = _cost(2, 4)
    x = _loads(5, 8, 16)
    home = static_placement(1, 16, 8)[0]
    rep = replicate_greedy(x, home, cost, 2)
    copies = (rep.assign > 0) | (np.arange(8) == home[:, None])
    lp = solve_split(x, home, cost, copies)
    assert lp.objective_s <= float(linear_objective(x, rep.assign, home, cost)) * (1 + 1e-6)


def test_greedy_with_lp_split_is_valid() -> None:
    cost = _cost(2, 2)
    x = np.stack([_loads(s, 4, 8) for s in range(2)])
    home = np.broadcast_to(static_placement(1, 8, 4)[0], (2, 8))
    rep = replicate_greedy(x, home, cost, 1, split="lp")
    check_assignment(
        home, rep.assign[None], x[None], gpus_per_node=2, replica_slots=1, replicas=rep.replicas[None]
    )
    base = float(linear_objective(x, replicate_greedy(x, home, cost, 0).assign, home, cost).sum())
    assert float(linear_objective(x, rep.assign, home, cost).sum()) <= base * (1 + 1e-9)


def test_milp_replicator_plan_and_stats() -> None:
    ctx = tiny_context(nodes=2, gpus_per_node=2, num_experts=8)
    rep = MilpReplicator(replica_slots=1, config=MilpConfig(time_limit_s=5.0))
    home = static_placement(ctx.counts.shape[1], 8, 4)
    out = rep.replicate(ctx.load[0], home, ctx)
    check_assignment(
        home, out.assign[None], ctx.load[:1], gpus_per_node=2, replica_slots=1, replicas=out.replicas[None]
    )
    assert out.stats["milp_optimal_fraction"] == 1.0
    assert 0.0 <= out.stats["milp_gap_max"] <= 1e-3
    assert out.stats["milp_bound_s"] <= out.stats["milp_objective_s"] * (1 + 1e-9)


def test_unknown_solver_is_refused() -> None:
    cost = _cost(1, 2)
    with pytest.raises(ValueError, match="NOPE"):
        solve_replication(_loads(0, 2, 4), static_placement(1, 4, 2)[0], cost, 1, solver="NOPE")
