"""relibra/megatron/planning.py under tensor and context parallelism: EP only the context is what it was,
array for array; under TP x CP a sample's ranks stay on one TP x CP group as the simulator lays them
(relibra.workload.parallel_workload), each GPU replays Megatron's chunk of each of its samples (CP chunks
``i`` and ``2 cp - 1 - i``, then its ``1 / tp``; relibra.workload.rank_tokens' counts), and the context's
loads count exactly the routes each GPU replays."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.cost.model import CostModel
from relibra.invariants import check_plan
from relibra.megatron.planning import (
    group_rank,
    microbatch_samples,
    plan_routes,
    planning_specs,
    rank_routes,
    rank_token_ranges,
    routes_context,
)
from relibra.megatron.replay import routes_to_trace
from relibra.parallel import ParallelDims
from relibra.planners.compose import relibra
from relibra.planners.reorder.config import AnnealConfig
from relibra.simulator import batch_context
from relibra.workload import build_workload, parallel_workload, rank_tokens
from tests.builders import HOPPER

G, LAYERS, EXPERTS, TOP_K = 8, 3, 16, 2
TP2_CP2 = ParallelDims(tp=2, cp=2)
TP4_CP4 = ParallelDims(tp=4, cp=4)
"""Wider than the EP group of 8 (Megatron-MoE-ModelZoo's 64K parallel dimensions): it holds ranks 0 .. 7, CP
ranks 0, 1."""
PARALLEL_CASES = [ParallelDims(tp=2), ParallelDims(cp=2), TP2_CP2, ParallelDims(tp=2, cp=4), TP4_CP4]


def _routes(num_samples: int = 12, seed: int = 0) -> list[np.ndarray]:
    """Distinct top-k routes of ``num_samples`` samples of 3 to 79 tokens (some shorter than ``2 cp tp``)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 80, size=num_samples)
    pop = np.linspace(3.0, 0.1, EXPERTS)  # a few hot experts
    return [
        np.argsort(-rng.gumbel(size=(int(t), LAYERS, EXPERTS)) - pop, axis=-1)[..., :TOP_K] for t in lengths
    ]


def _specs():
    return planning_specs(HOPPER, G, LAYERS, EXPERTS, TOP_K)


def _replayed(routes, ctx, parallel: ParallelDims, m: int, gpu: int, ep_group: int = 0) -> np.ndarray:
    """The routes GPU ``gpu`` replays in micro-batch ``m``."""
    samples = microbatch_samples(ctx.sample_gpu, ctx.sample_mb, gpu, m, parallel=parallel, num_gpus=G)
    return rank_routes(routes, samples, parallel, group_rank(gpu, parallel, G, ep_group))


def _bincount(routes: np.ndarray) -> np.ndarray:
    """int64 [L, E]: routed slots of ``routes`` [T, L, k] per layer and expert."""
    return np.stack([np.bincount(routes[:, l].ravel(), minlength=EXPERTS) for l in range(LAYERS)])


@pytest.mark.parametrize("spm", [None, 1, 2])
def test_ep_only_is_unchanged(spm: int | None) -> None:
    routes = _routes()
    cluster, model = _specs()
    # the path before TP x CP, written out
    counts = routes_to_trace(routes, EXPERTS, model=model.name).to_counts()
    workload = build_workload(counts, G, spm, span=model.attention_span)
    before = batch_context(counts, workload, 0, cluster, model, CostModel(cluster, model))
    for parallel in (None, ParallelDims()):
        ctx = routes_context(routes, cluster, model, spm, parallel=parallel)
        for name in ("counts", "sample_tokens", "sample_gpu", "sample_mb", "load"):
            got, want = getattr(ctx, name), getattr(before, name)
            np.testing.assert_array_equal(got, want, err_msg=name)
            assert got.dtype == want.dtype, name
        assert ctx.cost.parallel == ParallelDims() and ctx.seed == before.seed
        for m in range(ctx.num_microbatches):
            for gpu in range(G):
                plain = microbatch_samples(ctx.sample_gpu, ctx.sample_mb, gpu, m)
                np.testing.assert_array_equal(
                    microbatch_samples(ctx.sample_gpu, ctx.sample_mb, gpu, m, parallel=parallel), plain
                )
                np.testing.assert_array_equal(
                    rank_routes(routes, plain, ParallelDims(), 0),
                    np.concatenate([np.zeros((0, LAYERS, TOP_K), np.int64)] + [routes[s] for s in plain]),
                )


def test_rank_token_ranges_by_hand() -> None:
    # cp 2, t 8: chunks [0,2) [2,4) [4,6) [6,8); CP rank 0 holds chunks 0 and 3, CP rank 1 chunks 1 and 2
    np.testing.assert_array_equal(
        rank_token_ranges(np.array([8]), ParallelDims(cp=2))[0],
        [[[0, 2], [6, 8]], [[2, 4], [4, 6]]],
    )
    # tp 3, cp 2, t 12: CP rank 0 holds [0,3) + [9,12); its TP ranks 2 tokens each, the middle one straddles
    got = rank_token_ranges(np.array([12]), ParallelDims(tp=3, cp=2))[0]
    np.testing.assert_array_equal(got[0], [[0, 2], [9, 9]])
    np.testing.assert_array_equal(got[1], [[2, 3], [9, 10]])
    np.testing.assert_array_equal(got[2], [[3, 3], [10, 12]])
    np.testing.assert_array_equal(got[3], [[3, 5], [6, 6]])  # CP rank 1: [3,6) + [6,9)
    # tp 2 without CP: halves of the sample, the second range empty
    np.testing.assert_array_equal(
        rank_token_ranges(np.array([7]), ParallelDims(tp=2))[0], [[[0, 3], [7, 7]], [[3, 7], [7, 7]]]
    )


@pytest.mark.parametrize("parallel", PARALLEL_CASES, ids=lambda p: f"tp{p.tp}cp{p.cp}")
def test_rank_token_ranges_tile_each_sample_as_rank_tokens_counts(parallel: ParallelDims) -> None:
    tokens = np.arange(0, 70, dtype=np.int64)
    ranges = rank_token_ranges(tokens, parallel)  # [S, n, 2, 2]
    lengths = (ranges[..., 1] - ranges[..., 0]).sum(-1)
    assert (ranges[..., 1] >= ranges[..., 0]).all()
    np.testing.assert_array_equal(lengths, rank_tokens(tokens, parallel.tp, parallel.cp))
    for s, t in enumerate(tokens):
        held = np.concatenate([np.arange(a, b) for a, b in ranges[s].reshape(-1, 2)] + [np.zeros(0, int)])
        np.testing.assert_array_equal(np.sort(held), np.arange(t))  # every token on exactly one rank


@pytest.mark.parametrize("parallel", [TP2_CP2, TP4_CP4], ids=["tp2cp2", "tp4cp4"])
@pytest.mark.parametrize("spm", [1, 2])
def test_samples_stay_on_their_groups_and_each_gpu_replays_its_chunk(
    parallel: ParallelDims, spm: int
) -> None:
    routes = _routes()
    lengths = np.array([len(r) for r in routes], dtype=np.int64)
    cluster, model = _specs()
    ctx = routes_context(routes, cluster, model, spm, parallel=parallel)
    n, held = parallel.group, min(parallel.group, G)
    num_s = len(routes)
    assert ctx.cost.parallel == parallel and ctx.counts.shape == (num_s * held, LAYERS, EXPERTS)
    # the simulator's sample layout and tokens (parallel_workload), each sample's ranks on one group in rank
    # order
    sim_counts, sim = parallel_workload(
        routes_to_trace(routes, EXPERTS, model=model.name).to_counts(), parallel, G, spm,
        span=model.attention_span,
    )  # fmt: skip
    np.testing.assert_array_equal(ctx.sample_gpu, sim.sample_gpu)
    np.testing.assert_array_equal(ctx.sample_tokens, sim_counts.tokens)
    gpu = ctx.sample_gpu.reshape(num_s, held)
    np.testing.assert_array_equal(gpu, (gpu[:, :1] // held) * held + np.arange(held))
    assert (ctx.sample_mb.reshape(num_s, held) == ctx.sample_mb[::held, None]).all()
    np.testing.assert_array_equal(
        ctx.sample_tokens.reshape(num_s, held), rank_tokens(lengths, parallel.tp, parallel.cp)[:, :held]
    )
    # exact counts: every rank's routed slots are its tokens times top-k; whole groups conserve the sample's
    slots = ctx.counts.sum(-1)
    np.testing.assert_array_equal(slots, np.broadcast_to(ctx.sample_tokens[:, None] * TOP_K, slots.shape))
    whole = routes_to_trace(routes, EXPERTS, model=model.name).to_counts().counts
    if held == n:
        np.testing.assert_array_equal(ctx.counts.reshape(num_s, n, LAYERS, EXPERTS).sum(1), whole)
    # what each GPU replays: its rank's chunk of each sample of its group, counted exactly by the loads
    for m in range(ctx.num_microbatches):
        for g in range(G):
            samples = microbatch_samples(ctx.sample_gpu, ctx.sample_mb, g, m, parallel=parallel, num_gpus=G)
            rank = group_rank(g, parallel, G)
            assert rank == g % held
            mine = _replayed(routes, ctx, parallel, m, g)
            assert mine.shape[0] == rank_tokens(lengths[samples], parallel.tp, parallel.cp)[:, rank].sum()
            np.testing.assert_array_equal(ctx.load[m, :, g], _bincount(mine))
            ranges = rank_token_ranges(lengths[samples], parallel)[:, rank]
            expect = [routes[s][a:b] for s, spans in zip(samples, ranges) for a, b in spans]
            np.testing.assert_array_equal(mine, np.concatenate([np.zeros((0, LAYERS, TOP_K), int), *expect]))
    if held < n:
        # the other EP groups of a wider group replay the other ranks: over all of them every token once
        total = sum(
            _replayed(routes, ctx, parallel, m, g, k).shape[0]
            for m in range(ctx.num_microbatches)
            for g in range(G)
            for k in range(n // G)
        )
        assert total == lengths.sum()
    else:
        assert ctx.load.sum() == lengths.sum() * LAYERS * TOP_K


def test_a_plan_under_tp_cp_keeps_groups_and_replays() -> None:
    routes = _routes(16)
    cluster, model = _specs()
    anneal = AnnealConfig(iterations=50, aggregate_warmup=50, locality=True)
    plan, ctx = plan_routes(
        routes, relibra(replica_slots=2, reorder=anneal), cluster, model, 1, parallel=TP2_CP2
    )
    check_plan(plan, ctx, replica_slots=2)
    np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)  # the locality round moves no group
    for m in range(ctx.num_microbatches):
        for g in range(G):
            samples = microbatch_samples(plan.sample_gpu, ctx.sample_mb, g, m, parallel=TP2_CP2, num_gpus=G)
            mine = rank_routes(routes, samples, TP2_CP2, group_rank(g, TP2_CP2, G))
            np.testing.assert_array_equal(plan.load[m, :, g], _bincount(mine))


def test_bad_calls_name_the_problem() -> None:
    routes = _routes()
    cluster, model = _specs()
    ctx = routes_context(routes, cluster, model, 1, parallel=TP2_CP2)
    with pytest.raises(ValueError, match="needs num_gpus"):
        microbatch_samples(ctx.sample_gpu, ctx.sample_mb, 0, 0, parallel=TP2_CP2)
    moved = ctx.sample_gpu.copy()
    moved[0], moved[1] = moved[1], moved[0]  # ranks 0 and 1 of sample 0 swapped: a split group
    with pytest.raises(ValueError, match="a plan must move whole TP x CP groups"):
        microbatch_samples(
            moved, ctx.sample_mb, int(moved[0]), int(ctx.sample_mb[0]), parallel=TP2_CP2, num_gpus=G
        )
    with pytest.raises(ValueError, match=r"an EP group in \[0, 1\)"):
        group_rank(0, TP2_CP2, G, ep_group=1)
    with pytest.raises(ValueError, match=r"a rank in \[0, 4\)"):
        rank_routes(routes, np.array([0]), TP2_CP2, 4)
    with pytest.raises(ValueError, match="neither divides the other"):
        routes_context(routes, cluster, model, 1, parallel=ParallelDims(tp=2, cp=3))
