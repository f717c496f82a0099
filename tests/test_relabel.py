"""Relabelling keeps experts in place without changing what a plan costs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec
from relibra.cost.migration import MigrationPayload
from relibra.cost.model import CostModel
from relibra.cost.pricing import predict_batch_time
from relibra.planners.protocols import static_placement
from relibra.relabel import keep_in_place, permute_plan, relabel_plan
from relibra.simulator import batch_context
from relibra.workload import build_workload
from tests.builders import HOPPER, random_counts, tiny_model


def _moved(home: np.ndarray, prev: np.ndarray) -> int:
    return int(np.count_nonzero(home != prev))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(1, 4), (2, 2), (3, 2), (2, 4), (4, 1), (4, 2)]),
    layers=st.integers(1, 4),
    scramble=st.booleans(),
)
def test_relabelling_never_moves_more(seed: int, shape: tuple[int, int], layers: int, scramble: bool) -> None:
    nodes, gpn = shape
    g = nodes * gpn
    rng = np.random.default_rng(seed)
    prev = np.stack([rng.permutation(np.arange(2 * g) // 2) for _ in range(layers)])  # [L, E], 2 per GPU
    if scramble:  # a fabric symmetry of prev plus a few swaps: the relabelling should undo most of it
        pi, sigma = rng.permutation(nodes), rng.permutation(gpn)
        gg = np.arange(g)
        new = (pi[gg // gpn] * gpn + sigma[gg % gpn])[prev]
    else:
        new = np.stack([rng.permutation(np.arange(2 * g) // 2) for _ in range(layers)])
    perm = keep_in_place(new, prev, nodes, gpn)
    assert sorted(perm.tolist()) == list(range(g))
    # the relabelling is a fabric symmetry: same-node and same-rail pairs are kept
    gg = np.arange(g)
    assert np.array_equal((perm[:, None] // gpn == perm[None, :] // gpn), (gg[:, None] // gpn == gg // gpn))
    assert np.array_equal((perm[:, None] % gpn == perm[None, :] % gpn), (gg[:, None] % gpn == gg % gpn))
    assert _moved(perm[new], prev) <= _moved(new, prev)
    if scramble:
        assert _moved(perm[new], prev) == 0  # a pure symmetry is undone exactly (alternation is exact here)


def test_relabelling_is_exact_on_one_node() -> None:
    """One node: only rail permutations; the assignment problem keeps the most experts (brute force)."""
    from itertools import permutations

    rng = np.random.default_rng(0)
    prev = static_placement(3, 8, 4)
    new = np.stack([rng.permutation(prev[0]) for _ in range(3)])
    perm = keep_in_place(new, prev, 1, 4)
    best = min(_moved(np.array(p)[new], prev) for p in permutations(range(4)))
    assert _moved(perm[new], prev) == best


@pytest.mark.parametrize("name", ["relibra", "eplb", "lplb"])
def test_relabelled_plans_cost_the_same(name: str) -> None:
    """A plan and its relabelling by any fabric symmetry have the same step time except migration, and the
    planners' own plans come relabelled (at most as many moved experts as their plan as solved)."""
    from hydra.utils import instantiate

    from tests.builders import planner_config

    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=HOPPER)
    model = tiny_model(num_experts=8)
    cost = CostModel(cluster, model)
    counts = random_counts(num_experts=8, seed=5)
    work = build_workload(counts, 4, samples_per_microbatch=2)
    prev = static_placement(2, 8, 4)
    ctx = batch_context(counts, work, 0, cluster, model, cost, prev_home=prev)
    plan = instantiate(planner_config(name), _convert_="all").plan(ctx)
    assert plan.stats["reorder_moved_experts"] == _moved(plan.home, prev)
    assert plan.stats["relabel_kept_experts"] >= 0
    # any fabric symmetry: swap the nodes and the rails
    sym = permute_plan(plan, np.array([3, 2, 1, 0]))
    # NOTE: price without migration (a payload of 0 bytes): the relabelling changes nothing else.
    nothing = MigrationPayload(weight_bytes=0.0, master_weight_bytes=0.0, optimizer_state_bytes=0.0)
    free = replace(ctx, cost=CostModel(cluster, model, migration=nothing))
    t0 = predict_batch_time(plan, free)
    t1 = predict_batch_time(sym, free)
    assert t1 == pytest.approx(t0, rel=1e-9)
    back = relabel_plan(sym, plan.home, 2, 2)
    assert _moved(back.home, plan.home) == 0
    np.testing.assert_array_equal(back.assign, plan.assign)
    np.testing.assert_array_equal(back.sample_gpu, plan.sample_gpu)
