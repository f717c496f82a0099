"""The exact reordering MILP under ``cluster.dispatcher=deepep`` and ``cluster.ep_overlap``: brute force,
annealer, alltoall optimum."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from relibra.cost.model import CostModel
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.reorder.exact import brute_force_reorder, milp_reorder
from relibra.planners.reorder.kernels import anneal_layer, placement_objective
from relibra.planners.reorder.problem import layer_problem, lpt_placement
from tests.builders import layer_ctx


def _deepep(cost: CostModel) -> CostModel:
    return CostModel(replace(cost.cluster, dispatcher="deepep"), cost.model)


def _overlapped(cost: CostModel, dispatcher: str) -> CostModel:
    return CostModel(replace(cost.cluster, dispatcher=dispatcher, ep_overlap=True), cost.model)


@pytest.mark.parametrize("seed", [12, 3])
def test_deepep_milp_matches_brute_force_and_bounds_annealer(seed: int) -> None:
    """The product chains model DeepEP's estimate exactly: the MILP's optimum is brute force's."""
    ctx = layer_ctx(2, 2, 8, microbatches=2, seed=seed)
    problem = layer_problem(ctx.load[:, 0], _deepep(ctx.cost))
    assert problem.deepep
    brute = brute_force_reorder(problem, ctx.cluster)
    milp = milp_reorder(problem, ctx.cluster, time_limit_s=60)
    assert milp.optimal
    assert milp.objective_s == pytest.approx(brute.objective_s, rel=1e-6)
    assert milp.objective_s == pytest.approx(placement_objective(problem, milp.home, ctx.cluster), rel=1e-12)
    _, obj, _ = anneal_layer(problem, lpt_placement(problem.w.sum(axis=0), 4), ctx.cluster, AnnealConfig(), 1)
    assert obj >= milp.bound_s * (1 - 1e-6)


def test_deepep_optimum_beats_alltoalls_optimum_priced_under_deepep() -> None:
    """On this instance the placement that is optimal for alltoall is not for DeepEP: pricing DeepEP in the
    MILP itself matters (the alltoall model is no proxy for it)."""
    ctx = layer_ctx(2, 2, 8, microbatches=2, seed=12)
    deepep = layer_problem(ctx.load[:, 0], _deepep(ctx.cost))
    alltoall = milp_reorder(layer_problem(ctx.load[:, 0], ctx.cost), ctx.cluster, time_limit_s=60)
    ours = milp_reorder(deepep, ctx.cluster, time_limit_s=60, hint=alltoall.home)
    assert ours.objective_s < placement_objective(deepep, alltoall.home, ctx.cluster) * (1 - 1e-3)


def test_deepep_single_node_problem_has_no_node_terms() -> None:
    """One node: DeepEP sends over NVLink only, once per (token, GPU); the MILP still matches brute force."""
    ctx = layer_ctx(1, 4, 8, microbatches=1, seed=5)
    problem = layer_problem(ctx.load[:, 0], _deepep(ctx.cost))
    brute = brute_force_reorder(problem, ctx.cluster)
    milp = milp_reorder(problem, ctx.cluster, time_limit_s=60)
    assert milp.optimal
    assert milp.objective_s == pytest.approx(brute.objective_s, rel=1e-6)


@pytest.mark.parametrize(
    ("dispatcher", "seed", "level"),
    [
        ("alltoall", 12, "gpu"),
        ("alltoall", 3, "gpu"),
        ("deepep", 12, "gpu"),
        ("deepep", 3, "gpu"),
        ("alltoall", 4, "node"),
        ("deepep", 4, "node"),
    ],
)
def test_overlapped_milp_matches_brute_force_and_bounds_annealer(
    dispatcher: str, seed: int, level: str
) -> None:
    """Under ``cluster.ep_overlap`` (3 micro-batches, attention, migration; per-GPU or per-node compute) the
    MILP's proven optimum of the overlapped layer time is brute force's, its objective is its placement's
    true objective, and it bounds the annealer."""
    ctx = layer_ctx(2, 2, 8, microbatches=3, seed=seed)
    cost = _overlapped(ctx.cost, dispatcher)
    attention = np.random.default_rng(seed).uniform(0, 2e-4, size=3)
    prev = lpt_placement(ctx.load[:, 0].sum(axis=(0, 1)), 4)
    problem = layer_problem(
        ctx.load[:, 0], cost, attention=attention, prev_home=prev, migration_weight=0.5, compute_level=level
    )
    assert problem.overlap_mbs == 3 and problem.deepep == (dispatcher == "deepep") and np.any(problem.mig)
    assert problem.compute_group == (2 if level == "node" else 1)
    brute = brute_force_reorder(problem, cost.cluster)
    milp = milp_reorder(problem, cost.cluster, time_limit_s=60)
    assert milp.optimal
    assert milp.objective_s == pytest.approx(brute.objective_s, rel=1e-6)
    assert milp.objective_s == pytest.approx(placement_objective(problem, milp.home, cost.cluster), rel=1e-12)
    _, obj, _ = anneal_layer(
        problem, lpt_placement(problem.w.sum(axis=0), 4), cost.cluster, AnnealConfig(), 1
    )
    assert obj >= milp.bound_s * (1 - 1e-6)


def test_overlapped_milp_on_one_aggregate_row_matches_brute_force() -> None:
    """One row standing for 4 equal micro-batches (``layer_time``'s aggregate form, the annealer's warm-up
    objective): the MILP's optimum is brute force's."""
    ctx = layer_ctx(2, 2, 8, microbatches=2, seed=5)
    cost = _overlapped(ctx.cost, "alltoall")
    problem = layer_problem(ctx.load[:1, 0], cost, attention=np.array([1e-4]), microbatches=4)
    assert problem.overlap_mbs == 4 and problem.x.shape[0] == 1
    brute = brute_force_reorder(problem, cost.cluster)
    milp = milp_reorder(problem, cost.cluster, time_limit_s=60)
    assert milp.optimal
    assert milp.objective_s == pytest.approx(brute.objective_s, rel=1e-6)
