"""Megatron's combined 1F1B all-to-all overlap (relibra.cost.overlap) against hand-computed schedules."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from relibra.cost.model import CostModel
from relibra.cost.overlap import (
    OverlapNeighbours,
    best_chain,
    layer_time,
    microbatch_share,
    overlapped_time,
    pair_time,
    share_pieces,
)
from relibra.cost.pricing import attention_window
from relibra.invariants import check_assignment
from relibra.planners.protocols import home_assign, static_placement
from relibra.planners.refill import replicate_batch, replicate_within_window
from relibra.planners.reorder.anneal import AnnealingReorderer, solve_layer
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.reorder.exact import brute_force_reorder
from relibra.planners.reorder.kernels import (
    _apply_swap,
    _apply_swap_deepep,
    _evaluate,
    full_state,
    full_state_deepep,
    placement_objective,
)
from relibra.planners.reorder.links import deepep_routes, link_routes
from relibra.planners.reorder.problem import layer_problem
from relibra.planners.replicate.greedy import GreedyReplicator
from relibra.planners.replicate.milp import MilpConfig, MilpReplicator
from relibra.simulator import batch_context
from tests.builders import layer_ctx, make_cost, plan_share, tiny_setup


def test_two_microbatches_by_hand():
    # compute 3 and 6 s (forward 1 / 2, backward 2 / 4), comm 2 and 4 s (1 / 2 per pass).
    # F0 alone: 1 + 1. Pair (F1, B0): max(F1 comm 2, B0 compute 2) + max(B0 comm 1, F1 compute 2) = 4.
    # B1 alone: 4 + 2. Total 12 of the 15 without overlap: 3 s of communication stay exposed.
    total, exposed = overlapped_time(np.array([[3.0], [6.0]]), np.array([[2.0], [4.0]]), 0.0)
    assert total == pytest.approx(12.0)
    assert exposed == pytest.approx(3.0)


def test_one_microbatch_is_refused():
    with pytest.raises(ValueError, match=r"cluster\.ep_overlap needs at least 2 micro-batches"):
        overlapped_time(np.ones((1, 4)), np.ones((1, 4)), 0.0)


@settings(max_examples=50, deadline=None)
@given(
    comp=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
    comm=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
)
def test_overlap_is_bounded_by_compute_and_by_no_overlap(comp, comm):
    total, exposed = overlapped_time(comp, comm, 0.0)
    assert comp.sum() - 1e-9 <= total <= comp.sum() + comm.sum() + 1e-9
    assert -1e-9 <= exposed <= comm.sum() + 1e-9


# ------------------------------------------------------------------------------ the shared rule
def test_layer_time_and_microbatch_share_are_the_simulators_rule():
    rng = np.random.default_rng(4)
    comp, comm = rng.uniform(0, 5, size=(5, 1)), rng.uniform(0, 5, size=(5, 1))
    total, _ = overlapped_time(comp, comm, 0.0)
    assert layer_time(comp[:, 0], comm[:, 0], 5, math.inf, 0.0) == pytest.approx(total, rel=1e-12)
    # The terms micro-batch m enters, plus those it does not, give the layer's time for every m.
    for m in range(5):
        nb = np.array([-1.0, 0.0, -1.0, 0.0])
        if m > 0:
            nb[:2] = comp[m - 1, 0], comm[m - 1, 0]
        if m < 4:
            nb[2:] = comp[m + 1, 0], comm[m + 1, 0]
        zero_c, zero_k = comp.copy(), comm.copy()
        zero_c[m], zero_k[m] = 0.0, 0.0
        # layer time = share of m + terms without m, so the change of m's share is the layer's change
        share = microbatch_share(comp[m, 0], comm[m, 0], nb, math.inf, 0.0)
        share0 = microbatch_share(0.0, 0.0, nb, math.inf, 0.0)
        assert share - share0 == pytest.approx(total - overlapped_time(zero_c, zero_k, 0.0)[0], rel=1e-9)
    # Smoothed: never below the hard max, within log(2) / beta per max of two.
    for beta in (1.0, 10.0, 100.0):
        soft = layer_time(comp[:, 0], comm[:, 0], 5, beta, 0.0)
        assert total <= soft <= total + 2 * 4 * math.log(2) / beta + 1e-12


@settings(max_examples=100, deadline=None)
@given(
    own=arrays(np.float64, 2, elements=st.floats(0, 10)),
    nb=arrays(np.float64, 4, elements=st.floats(0, 10)),
    first=st.booleans(),
    last=st.booleans(),
    contention=st.floats(0.0, 0.9),
)
def test_share_pieces_are_microbatch_share(own, nb, first, last, contention):
    """The affine pieces the MILP and LP minimise (one epigraph variable per max) sum to the share, with
    or without SM contention."""
    nb = nb.copy()
    nb[0] = -1.0 if first else nb[0]
    nb[2] = -1.0 if last else nb[2]
    pieces = share_pieces(nb, contention)
    assert np.all(pieces[..., :2] >= 0.0)  # non-decreasing in C and K: the epigraph form is exact
    c, k = own
    terms = pieces[..., 0] * c + pieces[..., 1] * k + pieces[..., 2]  # [4, 2]
    assert terms.max(axis=1).sum() == pytest.approx(
        microbatch_share(c, k, nb, math.inf, contention), rel=1e-12, abs=1e-12
    )
    assert np.isinf(pieces[:2, 1, 2]).all() == first and np.isinf(pieces[2:, 1, 2]).all() == last


def test_contention_charges_the_compute_beside_the_all_to_all_by_hand():
    """Two micro-batches, one layer, the all-to-all holding s = 1/4 of the SMs: the pair (B[0], F[1]) is
    max(K1/2, 2 C0/3 + s K1/2) + max(K0/2, C1/3 + s K0/2); the first forward and the last backward run
    alone."""
    comp, comm, s = np.array([[3.0], [6.0]]), np.array([[2.0], [4.0]]), 0.25
    alone = (3.0 / 3 + 2.0 / 2) + (2 * 6.0 / 3 + 4.0 / 2)
    pair = max(4.0 / 2, 2 * 3.0 / 3 + s * 4.0 / 2) + max(2.0 / 2, 6.0 / 3 + s * 2.0 / 2)
    total, exposed = overlapped_time(comp, comm, s)
    assert total == pytest.approx(alone + pair, rel=1e-15) and total == pytest.approx(
        8.0 + 2.5 + 2.25, rel=1e-15
    )
    assert exposed == pytest.approx(total - 9.0, rel=1e-15)  # what the compute (9 s) does not cover
    assert overlapped_time(comp, comm, 0.0)[0] == pytest.approx(8.0 + 2.0 + 2.0, rel=1e-15)
    # a compute that fits in the all-to-all at the reduced rate: the all-to-all bounds the pair
    assert pair_time(0.3, 9.0, 0.3, 9.0, math.inf, 0.5) == pytest.approx(4.5 + 4.5, rel=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    comp=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
    comm=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
    s=st.floats(0.0, 1.0),
)
def test_contention_stays_between_full_overlap_and_none(comp, comm, s):
    """More SM contention never speeds a step up; at any share the step lies between the perfectly
    overlapped one and the serial sum (s = 1: the compute gets nothing while the all-to-all runs)."""
    free, _ = overlapped_time(comp, comm, 0.0)
    held, _ = overlapped_time(comp, comm, s)
    more, _ = overlapped_time(comp, comm, min(1.0, s + 0.1))
    tol = 1e-9 * (1.0 + float(comp.sum() + comm.sum()))
    assert free - tol <= held <= more + tol
    assert held <= float(comp.sum() + comm.sum()) + tol
    assert overlapped_time(comp, comm, 1.0)[0] == pytest.approx(float(comp.sum() + comm.sum()), rel=1e-12)


def test_aggregate_row_is_equal_microbatches():
    comp, comm = np.array([3.0, 3.0, 3.0]), np.array([5.0, 5.0, 5.0])
    assert layer_time(np.array([9.0]), np.array([15.0]), 3, math.inf, 0.0) == pytest.approx(
        layer_time(comp, comm, 3, math.inf, 0.0), rel=1e-12
    )


# ----------------------------------------------------------------------------- the annealer
def _overlap_cost(nodes: int, gpus_per_node: int, num_experts: int, top_k: int = 1) -> CostModel:
    return make_cost(nodes, gpus_per_node, num_experts, num_layers=1, top_k=top_k, ep_overlap=True)


def _priced(
    load: np.ndarray, home: np.ndarray, cost: CostModel, attention: np.ndarray
) -> tuple[float, float]:
    """(sum of T_MoE + attention, overlapped time) of home-only placement ``home`` [E] for load [Mb, G, E],
    from the cost model (the simulator's pricing of one layer)."""
    a = home_assign(load, np.broadcast_to(home, load.shape[:1] + home.shape), load.shape[1])
    br = cost.moe(load, a)
    comp = br.t_compute + attention
    return float((comp + br.t_comm).sum()), overlapped_time(comp[:, None], br.t_comm[:, None], 0.0)[0]


def test_overlap_prefers_a_different_placement_by_hand():
    # One node, 2 GPUs, experts a and b. Micro-batch 0: GPU 0 holds 4000 tokens for a, GPU 1 4000 for b;
    # micro-batch 1: GPU 0 holds 4400 for b, GPU 1 4400 for a. Compute is the same for both placements
    # (C = 168.8 and 185.2 us: 40.9 ns a token plus 5.2 us an expert); the communication sits in one
    # micro-batch or the other (a 40 us latency floor where every token stays local):
    #   P1 = (a on 0, b on 1): K = (40, 240.2) us; sum 634.2 us; overlapped
    #        C0/3 + K0/2 + max(K1/2, 2 C0/3) + max(K0/2, C1/3) + 2 C1/3 + K1/2
    #      = 56.3 + 20 + 120.1 + 61.7 + 123.4 + 120.1 = 501.7 us,
    #   P2 = (b on 0, a on 1): K = (222.0, 40) us; sum 616.0 us; overlapped
    #      = 56.3 + 111.0 + 112.5 + 111.0 + 123.4 + 20 = 534.3 us.
    # The sum prefers P2 (less communication); the overlap P1, whose communication is in micro-batch 1's
    # forward, hidden behind micro-batch 0's backward compute.
    cost = _overlap_cost(1, 2, 2)
    load = np.array([[[4000, 0], [0, 4000]], [[0, 4400], [4400, 0]]])
    attention = np.zeros(2)
    p1, p2 = np.array([0, 1]), np.array([1, 0])
    s1, o1 = _priced(load, p1, cost, attention)
    s2, o2 = _priced(load, p2, cost, attention)
    assert (s1 * 1e6, o1 * 1e6) == pytest.approx((634.2, 501.7), abs=0.1)
    assert (s2 * 1e6, o2 * 1e6) == pytest.approx((616.0, 534.3), abs=0.1)
    problem = layer_problem(load, cost)
    assert placement_objective(problem, p1, cost.cluster) == pytest.approx(o1, rel=1e-9)
    assert placement_objective(problem, p2, cost.cluster) == pytest.approx(o2, rel=1e-9)
    config = AnnealConfig(iterations=200, aggregate_warmup=0, seeds=(0,))
    for start in (p1, p2):
        home, obj, _ = solve_layer(load, cost, config, start=start)
        assert home.tolist() == p1.tolist() and obj == pytest.approx(o1, rel=1e-9)
    # Without the overlap the same annealer keeps P2.
    plain = CostModel(replace(cost.cluster, ep_overlap=False), cost.model)
    home, obj, _ = solve_layer(load, plain, config, start=p1)
    assert home.tolist() == p2.tolist() and obj == pytest.approx(s2, rel=1e-9)


def _random_layer(seed: int, nodes: int, gpn: int, e: int, mb: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    topic = rng.dirichlet(np.full(e, 0.3), size=mb)  # [Mb, E]
    return np.stack(
        [rng.multinomial(int(rng.integers(500, 4000)), topic[m], size=nodes * gpn) for m in range(mb)]
    )


@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
@pytest.mark.parametrize(("nodes", "gpn", "group"), [(2, 2, 1), (2, 4, 1), (4, 2, 2), (1, 4, 1)])
def test_incremental_overlapped_objective_equals_recomputation(nodes, gpn, group, dispatcher):
    """Random swaps applied incrementally, then the kernel's overlapped objective against
    :func:`overlapped_time` of the same placement recomputed from scratch (compute from the loads, the
    communication from the cost model)."""
    e, mb = 4 * nodes * gpn, 4
    g = nodes * gpn
    cost = _overlap_cost(nodes, gpn, e, top_k=2)
    cost = CostModel(replace(cost.cluster, dispatcher=dispatcher), cost.model)
    load = _random_layer(nodes * 100 + gpn, nodes, gpn, e, mb)
    attention = np.random.default_rng(1).uniform(0, 2e-4, size=mb)
    problem = layer_problem(load, cost, attention=attention, compute_level="node" if group > 1 else "gpu")
    assert problem.overlap_mbs == mb
    idx, cnt = link_routes(nodes, gpn)
    rng = np.random.default_rng(2)
    home = rng.permutation(np.repeat(np.arange(g), e // g)).astype(np.int64)
    if dispatcher == "alltoall":
        comp, link, migr = full_state(home, problem.x, problem.w, idx, cnt, problem.mig)
    else:
        deepep_args = (problem.lq, problem.tok, problem.w, deepep_routes(nodes, gpn), nodes, problem.mig)
        comp, link, migr, lg, ln = full_state_deepep(home, *deepep_args)
    for _ in range(300):
        a = int(rng.integers(e))
        b = int(rng.choice(np.flatnonzero(home != home[a])))
        p, q = int(home[a]), int(home[b])
        if dispatcher == "alltoall":
            _apply_swap(a, b, p, q, problem.x, problem.w, idx, cnt, problem.mig, comp, link, migr)
        else:
            _apply_swap_deepep(a, b, p, q, *deepep_args, comp, link, migr, lg, ln)
        home[a], home[b] = q, p
    arg = np.zeros((mb, 2), dtype=np.int64)
    inc, _ = _evaluate(
        comp,
        link,
        migr,
        problem.coef,
        50.0,
        arg,
        group,
        problem.attn,
        problem.overlap_mbs,
        problem.contention,
    )
    inc *= problem.scale
    assert inc == pytest.approx(placement_objective(problem, home, cost.cluster), rel=1e-9)
    lin = cost.linear()
    tokens = load.sum(axis=1).astype(np.float64)  # [Mb, E]
    w = lin.compute_s_per_token * tokens + lin.compute_s_per_expert * (tokens > 0)
    comp_g = np.stack([np.bincount(home, weights=w[m], minlength=g) for m in range(mb)])
    comp_g = comp_g.reshape(mb, g // group, group).mean(axis=2)
    t_comm = cost.moe(load, home_assign(load, np.broadcast_to(home, (mb, e)), g)).t_comm
    ref, _ = overlapped_time(
        (comp_g.max(axis=1) + attention)[:, None], t_comm[:, None], cost.cluster.comm_sm_share
    )
    assert inc == pytest.approx(ref, rel=1e-9)


def test_annealer_reaches_the_overlapped_optimum_on_small_cases():
    # NOTE: without the aggregate warm-up: the main phase then starts hot, and on these instances it reaches
    # the enumerated optimum, of the sum objective as of the overlapped one.
    cost = _overlap_cost(2, 2, 8, top_k=2)
    config = AnnealConfig(seeds=(0, 1), aggregate_warmup=0)
    for seed in range(4):
        load = _random_layer(seed, 2, 2, 8, 3)
        attention = np.full(3, 1e-4)
        problem = layer_problem(load, cost, attention=attention)
        brute = brute_force_reorder(problem, cost.cluster)
        home, obj, start = solve_layer(load, cost, config, attention=attention)
        assert obj <= start + 1e-15
        assert obj == pytest.approx(brute.objective_s, rel=1e-9)
        assert placement_objective(problem, home, cost.cluster) == pytest.approx(obj, rel=1e-12)


@pytest.mark.parametrize("objective", ["microbatch", "aggregate"])
def test_annealing_reorderer_reads_the_overlap_from_the_cost_model(objective):
    """Under ep_overlap=true (on ctx.cost) the reorderer's objective is each layer's overlapped time with
    the batch's attention (the aggregate form: the summed loads as equal micro-batches); the same batch
    without the overlap gets the sum of T_MoE."""

    base = layer_ctx(2, 2, 16, num_layers=2, microbatches=3, seed=9, alpha=0.2)
    over_cost = CostModel(replace(base.cluster, ep_overlap=True), base.model)
    over = replace(base, cluster=over_cost.cluster, cost=over_cost)
    config = AnnealConfig(seeds=(0,), objective=objective)
    attention = attention_window(over, over.sample_gpu)
    assert attention.min() > 0
    for ctx, attn in ((base, None), (over, attention)):
        out = AnnealingReorderer(config).reorder(ctx)
        expect = 0.0
        for l in range(2):
            load_l, attn_l = np.asarray(ctx.load[:, l]), attn
            if objective == "aggregate":
                load_l = load_l.sum(axis=0, keepdims=True)
                attn_l = None if attn is None else attn.sum(keepdims=True)
            problem = layer_problem(load_l, ctx.cost, attention=attn_l, microbatches=3)
            assert problem.overlap_mbs == (3 if attn is not None else 0)
            expect += placement_objective(problem, out.home[l], ctx.cluster)
        assert out.stats["reorder_objective_s"] == pytest.approx(expect, rel=1e-9)


def test_milp_reorder_finds_the_overlaps_placement_by_hand():
    """The by-hand case of :func:`test_overlap_prefers_a_different_placement_by_hand`: the MILP proves P1
    (501.7 us overlapped) optimal under the overlap and P2 (616.0 us summed) without it."""
    from relibra.planners.reorder.exact import milp_reorder

    cost = _overlap_cost(1, 2, 2)
    load = np.array([[[4000, 0], [0, 4000]], [[0, 4400], [4400, 0]]])
    overlapped = milp_reorder(layer_problem(load, cost), cost.cluster)
    assert overlapped.optimal and overlapped.home.tolist() == [0, 1]
    assert overlapped.objective_s * 1e6 == pytest.approx(501.7, abs=0.1)
    plain = CostModel(replace(cost.cluster, ep_overlap=False), cost.model)
    summed = milp_reorder(layer_problem(load, plain), plain.cluster)
    assert summed.optimal and summed.home.tolist() == [1, 0]
    assert summed.objective_s * 1e6 == pytest.approx(616.0, abs=0.1)


# ------------------------------------------------------------------------------ the replication
def test_best_chain_is_the_enumerated_best_mix():
    import itertools

    rng = np.random.default_rng(7)
    for _ in range(20):
        c, m = int(rng.integers(1, 4)), int(rng.integers(2, 6))
        comp, comm, extra = rng.uniform(0, 3, (c, m)), rng.uniform(0, 3, (c, m)), rng.uniform(0, 0.5, (c, m))

        def total(pick, comp=comp, comm=comm, extra=extra):
            cols = np.arange(len(pick))
            return (
                layer_time(comp[pick, cols], comm[pick, cols], len(pick), math.inf, 0.0)
                + extra[pick, cols].sum()
            )

        best = min(total(np.array(p)) for p in itertools.product(range(c), repeat=m))
        assert total(best_chain(comp, comm, extra, 0.0)) == pytest.approx(best, rel=1e-12)


def _overlap_setup(seed: int, nodes: int = 2, gpn: int = 2, experts: int = 8):
    counts, workload, cluster, model, _ = tiny_setup(
        nodes=nodes, gpus_per_node=gpn, num_experts=experts, samples_per_microbatch=1, seed=seed
    )
    cluster = replace(cluster, ep_overlap=True)
    cost = CostModel(cluster, model)
    return counts, workload, cluster, model, cost


def _layer_times(ctx, load, home, reps) -> float:
    """The overlapped MoE time plus exposed refill of the batch's replications, as the simulator prices it."""
    window = attention_window(ctx, ctx.sample_gpu)
    cost = ctx.cost
    comp = np.stack([cost.moe(load[m], r.assign).t_compute + window[m] for m, r in enumerate(reps)])
    comm = np.stack([cost.moe(load[m], r.assign).t_comm for m, r in enumerate(reps)])
    exposed = sum(
        cost.exposed_refill(cost.replica_refill_time(r.replicas, home), window[m]).sum()
        for m, r in enumerate(reps)
    )
    return overlapped_time(comp, comm, 0.0)[0] + float(exposed)


@pytest.mark.parametrize(("nodes", "gpn"), [(1, 4), (2, 2), (2, 4)])
def test_overlap_replication_is_never_worse_than_the_sum_objective(nodes, gpn):
    """The guarantee of replicate_batch under the overlap: per layer the exact best mix of the first pass
    (each micro-batch's own T_MoE, the answer without the overlap) and the second (its share of the
    overlapped time), so never worse as the simulator prices it; and the second pass does get used."""

    better = 0
    for seed in range(3):
        base = layer_ctx(
            nodes, gpn, 16, num_layers=2, microbatches=3, seed=seed, alpha=0.2, samples_per_gpu=4
        )
        cost = CostModel(replace(base.cluster, ep_overlap=True), base.model)
        ctx = replace(base, cluster=cost.cluster, cost=cost)
        home = static_placement(2, 16, ctx.num_gpus)
        replicator = GreedyReplicator(replica_slots=2)
        window = attention_window(ctx, ctx.sample_gpu)
        load = np.asarray(ctx.load)
        first = [replicate_within_window(replicator, load[m], home, ctx, window[m]) for m in range(3)]
        out = replicate_batch(replicator, load, home, ctx, ctx.sample_gpu)
        before, after = _layer_times(ctx, load, home, first), _layer_times(ctx, load, home, out)
        assert after <= before * (1 + 1e-12)
        better += after < before * (1 - 1e-9)
        assert 0.0 <= out[0].stats["overlap_second_pass_share"] <= 1.0
        for m, r in enumerate(out):  # every answer conserves the tokens
            np.testing.assert_array_equal(r.assign.sum(axis=-1), load[m].sum(axis=-2))
    assert better > 0


def test_greedy_under_overlap_never_raises_its_share():
    """replicate_greedy (either split) keeps only moves that lower its objective, so under the overlap its
    share (linearised, as it prices it) is never above the home-only answer's."""
    from relibra.planners.replicate.greedy import replicate_greedy

    counts, workload, cluster, model, cost = _overlap_setup(3, nodes=2, gpn=4, experts=16)
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    rng = np.random.default_rng(0)
    for m in range(ctx.num_microbatches):
        load = np.asarray(ctx.load[m])
        num_layers = load.shape[0]
        nb = np.column_stack([rng.uniform(0, 4e-4, num_layers), rng.uniform(0, 4e-4, num_layers)] * 2)
        nb[:, 0] = -1.0 if m == 0 else nb[:, 0]
        overlap = OverlapNeighbours(np.full(num_layers, 5e-5), nb, 0.0)
        for split in ("waterfill", "lp"):
            rep = replicate_greedy(load, home, cost, 2, overlap=overlap, split=split)
            check_assignment(
                home,
                rep.assign[None],
                load[None],
                gpus_per_node=4,
                replica_slots=2,
                replicas=rep.replicas[None],
            )
            own = plan_share(load, rep.assign, home, cost, overlap)
            base = plan_share(load, home_assign(load, home, cluster.num_gpus), home, cost, overlap)
            assert np.all(own <= base * (1 + 1e-9)), split


@pytest.mark.slow
def test_milp_overlap_replication_is_never_worse_than_before():
    """relibra_milp's replicator through replicate_batch under the overlap: the second pass now minimises
    each micro-batch's share with the MILP; the batch is never worse, as the simulator prices it (layer
    overlapped time plus exposed refill), than the first pass alone, i.e. the MILP on each problem's own
    T_MoE, which is what the MILP answered before it priced the overlap."""
    better = 0
    for seed in range(2):
        # NOTE: one node: at 2 x 2 these problems are so communication-bound that the overlap hides all of
        # the compute and the share's optimum is the T_MoE plan's
        base = layer_ctx(1, 4, 16, num_layers=2, microbatches=3, seed=seed, alpha=0.2, samples_per_gpu=4)
        cost = CostModel(replace(base.cluster, ep_overlap=True), base.model)
        ctx = replace(base, cluster=cost.cluster, cost=cost)
        home = static_placement(2, 16, ctx.num_gpus)
        replicator = MilpReplicator(2, MilpConfig(time_limit_s=5.0))
        window = attention_window(ctx, ctx.sample_gpu)
        load = np.asarray(ctx.load)
        first = [replicate_within_window(replicator, load[m], home, ctx, window[m]) for m in range(3)]
        out = replicate_batch(replicator, load, home, ctx, ctx.sample_gpu)
        before, after = _layer_times(ctx, load, home, first), _layer_times(ctx, load, home, out)
        assert after <= before * (1 + 1e-12)
        better += after < before * (1 - 1e-9)
        for m, r in enumerate(out):
            np.testing.assert_array_equal(r.assign.sum(axis=-1), load[m].sum(axis=-2))
    assert better > 0


# ------------------------------------------------------------------------------ the locality round
@pytest.mark.parametrize("dispatcher", ["alltoall", "deepep"])
def test_locality_round_never_worse_under_overlap(dispatcher):
    """The hill climb's proxy is alltoall's communication without overlap; its guard keeps the round only
    where the simulator's price of the home-only plan (overlapped, the configured dispatcher) does not
    grow, so the result is never worse than the input assignment."""
    from relibra.planners.reorder.locality import _overlapped, locality_round

    kept = 0
    for seed in range(4):
        base = layer_ctx(2, 2, 16, num_layers=2, microbatches=3, seed=seed, alpha=0.2)
        cost = CostModel(replace(base.cluster, ep_overlap=True, dispatcher=dispatcher), base.model)
        ctx = replace(base, cluster=cost.cluster, cost=cost)
        home = static_placement(2, 16, 4)
        new_gpu, stats = locality_round(ctx, home, tolerance=0.2)
        new_load = ctx.regroup(new_gpu)[0]
        assert _overlapped(ctx, new_load, home, new_gpu) <= _overlapped(ctx, ctx.load, home, ctx.sample_gpu)
        assert stats["locality_reverted"] in (0.0, 1.0)
        kept += stats["locality_moved_samples"] > 0
    assert kept > 0  # the round does move samples under the overlap


def test_entry_point_accepts_the_lp_split_under_overlap():
    from hydra import compose, initialize_config_dir

    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError
    from experiments.config.presets import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        overrides = [
            "cluster.ep_overlap=true",
            "planner=relibra",
            "planner.replicate.split=lp",
            "cluster.nodes=1",
        ]
        cfg = compose(config_name="config", overrides=overrides)
    check_config(cfg)  # the LP split prices the overlap now: nothing to refuse
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        one = compose(config_name="config", overrides=[*overrides[:3], "trace.samples_per_batch=1"])
    with pytest.raises(ConfigError, match=r"cluster\.ep_overlap=true needs at least 2 micro-batches"):
        check_config(one)  # the overlap's own check still runs
