"""PopFetcher: prediction, the pull test, prefetch buffer contents, hit rate, and the plan invariants."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.popfetcher import PopFetcherPlanner, adjacent_layer_transition, pull_threshold
from relibra.invariants import check_plan
from relibra.planners.protocols import home_assign
from tests.builders import make_ctx


def test_transition_recovers_a_deterministic_chain() -> None:
    """GPU j sends only to expert j at layer 0 and to expert (j + 1) % E at layer 1."""
    g = e = 4
    window = np.zeros((3, 2, g, e))
    window[:, 0, np.arange(g), np.arange(e)] = 5.0
    window[:, 1, np.arange(g), (np.arange(e) + 1) % e] = 5.0
    trans = adjacent_layer_transition(window)
    np.testing.assert_allclose(trans[1], np.eye(e)[(np.arange(e) + 1) % e])
    assert (trans[0] == 0).all()


def test_pull_threshold_balances_bytes() -> None:
    hidden, expert_bytes = 2048, 3 * 2048 * 768 * 2.0
    t = pull_threshold(hidden, expert_bytes, 1.0)
    assert t * 4 * hidden * 2 == pytest.approx(2 * expert_bytes)
    assert pull_threshold(hidden, expert_bytes, 2.0) == pytest.approx(2 * t)


@pytest.mark.parametrize("history", [0, 3])
def test_plan_invariants_and_prefetch_contents(history: int) -> None:
    ctx = make_ctx(history=history, microbatches=4, samples=64)
    planner = PopFetcherPlanner(replica_slots=2, pull_ratio=0.05)
    plan = planner.plan(ctx)
    check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=False)
    assert plan.replicas is not None and plan.replicas.shape == (4, 3, 8, 2)
    assert plan.stats["prefetched_experts"] > 0
    if history == 0:
        assert (plan.replicas[0] == -1).all()  # nothing to predict from before the first micro-batch
    m, l, g, s = np.nonzero(plan.replicas >= 0)
    e = plan.replicas[m, l, g, s]
    assert (plan.home[l, e] != g).all()
    # a prefetched expert serves exactly the GPU's own tokens for it
    np.testing.assert_array_equal(plan.assign[m, l, e, g], ctx.load[m, l, g, e])
    assert 0.0 <= plan.stats["prediction_hit_rate"] <= 1.0


def test_no_prefetch_when_tokens_never_outweigh_parameters() -> None:
    ctx = make_ctx(history=2)
    plan = PopFetcherPlanner(pull_ratio=1e6).plan(ctx)
    assert plan.replicas is not None and (plan.replicas == -1).all()
    np.testing.assert_array_equal(plan.assign, home_assign(ctx.load, plan.home, ctx.num_gpus))


def test_stationary_routing_is_predicted_exactly() -> None:
    ctx = make_ctx(microbatches=2, samples=32, seed=4)
    steady = replace(ctx, history=(np.concatenate([ctx.load, ctx.load]),))
    steady = replace(steady, load=np.concatenate([ctx.load[:1], ctx.load[:1]]))
    steady = replace(steady, sample_mb=np.zeros_like(ctx.sample_mb))
    plan = PopFetcherPlanner(correlation_weight=0.0, pull_ratio=0.05).plan(steady)
    assert plan.stats["prediction_hit_rate"] > 0.9


def test_wrong_history_lowers_the_hit_rate() -> None:
    ctx = make_ctx(microbatches=1, samples=16, seed=5, skew=0.1)
    flipped = ctx.load[..., ::-1].copy()  # history popular where this batch is not
    wrong = replace(ctx, history=(flipped,))
    right = replace(ctx, history=(ctx.load.copy(),))
    planner = PopFetcherPlanner(correlation_weight=0.0, popular_experts=2)
    assert planner.plan(wrong).stats["prediction_hit_rate"] < planner.plan(right).stats["prediction_hit_rate"]


def test_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="redundant_slots"):
        PopFetcherPlanner(redundant_slots=1)
    with pytest.raises(ValueError, match="correlation_weight"):
        PopFetcherPlanner(correlation_weight=2.0)


@given(seed=st.integers(0, 2**31 - 1), fractional=st.booleans())
@settings(max_examples=40, deadline=None)
def test_transition_equals_the_einsum_sum_bit_for_bit(seed: int, fractional: bool) -> None:
    """Whole-number windows take BLAS's matmul (every sum exact), others einsum: the numbers of the
    einsum the transition used before, either way."""
    rng = np.random.default_rng(seed)
    window = rng.poisson(rng.gamma(0.5, 30.0, size=(1, 1, 1, 16)), size=(3, 4, 8, 16)).astype(np.float64)
    if fractional:
        window = window * 0.37
    x = window
    prev = x[:, :-1].transpose(1, 0, 2, 3).reshape(3, 24, 16)
    cur = x[:, 1:].transpose(1, 0, 2, 3).reshape(3, 24, 16)
    co = np.einsum("lse,lsf->lef", prev, cur)
    rows = co.sum(-1, keepdims=True)
    want = np.zeros((4, 16, 16))
    want[1:] = np.divide(co, rows, out=np.zeros_like(co), where=rows > 0)
    assert np.array_equal(adjacent_layer_transition(window), want)


def _hot_node_run(planner, tokens: int):
    """Simulate ``planner`` on 3 batches of a lasting hot node (2 nodes x 4 GPUs, 16 Qwen3-30B-A3B-shaped
    experts, top-4): node 0's 8 experts take 70 % of the slots, one ``tokens``-token sample per GPU."""
    from relibra.simulator import SimOptions, simulate
    from relibra.workload import build_workload
    from tests.builders import make_cost
    from tests.planners.hot_sets import hot_set_counts

    cost = make_cost(2, 4, 16, num_layers=2, top_k=4)
    counts = hot_set_counts(
        num_experts=16, num_layers=2, top_k=4, num_gpus=8, gpus_per_node=4, batches=3, tokens=tokens,
        hot_share=0.7,
    )  # fmt: skip
    workload = build_workload(counts, 8, samples_per_microbatch=1)
    return simulate(planner, counts, workload, cost.cluster, cost.model, cost, SimOptions(check_plans=True))


def test_default_settings_prefetch_where_tokens_outweigh_weights() -> None:
    """4096 tokens per GPU: each of node 1's GPUs sends about 1430 tokens to every hot expert, above the pull
    threshold (1152 tokens for this expert shape), so the default PopFetcher must prefetch and beat the
    static placement it starts from."""
    from baselines.megatron import MegatronPlanner

    res = _hot_node_run(PopFetcherPlanner(), tokens=4096)
    assert res.metrics["pull_threshold_tokens"] == pytest.approx(1152.0)
    assert res.metrics["prefetched_experts"] > 0 and res.metrics["prefetch_useful_rate"] > 0.5
    static = _hot_node_run(MegatronPlanner(), tokens=4096)
    assert res.metrics["step_time_s"] < static.metrics["step_time_s"]


def test_no_prefetch_below_the_threshold_even_when_hot() -> None:
    """At 1024 tokens per GPU (the token-imbalance benchmark's size) no GPU can send an expert more tokens
    than the threshold, however hot: not prefetching is the method's answer there, not a fault."""
    res = _hot_node_run(PopFetcherPlanner(), tokens=1024)
    assert res.metrics["pull_threshold_tokens"] > 1024 and res.metrics["prefetched_experts"] == 0
