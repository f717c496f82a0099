"""Attention pairs under a sliding window (relibra/attention_span.py) and their one use everywhere."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.attention_span import FULL_CAUSAL, AttentionSpan
from relibra.cluster import ModelSpec
from relibra.cost.pricing import attention_window, price_plan
from relibra.layout import layout_samples
from relibra.planners.protocols import home_assign, static_placement
from relibra.planners.reorder import locality
from relibra.planners.reorder.locality import locality_round
from relibra.types import BatchPlan
from relibra.workload import build_workload, gpu_token_stats
from tests.builders import layer_ctx
from tests.test_workload import make_counts


def test_pairs_by_hand() -> None:
    lens = np.array([0, 1, 3, 4, 10])
    # full causal: t (t + 1) / 2
    np.testing.assert_array_equal(FULL_CAUSAL.pairs(lens), [0, 1, 6, 10, 55])
    # window of 4 keys on every layer: 1 + 2 + 3 + 4 + 4 * (t - 4)
    np.testing.assert_array_equal(AttentionSpan(4, 1.0).pairs(lens), [0, 1, 6, 10, 34])
    # half the layers windowed: the mean of the two
    np.testing.assert_array_equal(AttentionSpan(4, 0.5).pairs(lens), [0, 1, 6, 10, 44.5])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 300), min_size=1, max_size=12),
    st.integers(1, 64),
    st.sampled_from([0.0, 0.25, 0.5, 1.0]),
)
def test_pairs_equal_the_sum_over_queries(lens: list[int], window: int, share: float) -> None:
    """Each query i of a sample attends to min(i + 1, w) keys on a windowed layer, i + 1 on a full one."""
    span = AttentionSpan(window, share)
    want = [sum((1 - share) * (i + 1) + share * min(i + 1, window) for i in range(t)) for t in lens]
    np.testing.assert_allclose(span.pairs(np.array(lens)), want, rtol=1e-12, atol=1e-9)


def test_a_window_as_long_as_the_sample_changes_nothing() -> None:
    lens = np.array([1, 17, 128])
    np.testing.assert_array_equal(AttentionSpan(128, 0.5).pairs(lens), FULL_CAUSAL.pairs(lens))


@pytest.mark.parametrize(
    ("window", "share", "message"),
    [(0, 0.5, "window=0"), (None, 0.5, "no window"), (8, 1.5, r"\[0, 1\]"), (8, -0.1, r"\[0, 1\]")],
)
def test_bad_spans_are_refused(window: int | None, share: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionSpan(window, share)


def _model(**kw: object) -> ModelSpec:
    base = dict(
        name="m", num_layers=4, num_moe_layers=4, hidden=64, moe_ffn=32, num_experts=8, top_k=2,
        num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    return ModelSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_model_span() -> None:
    assert _model().attention_span is FULL_CAUSAL
    assert _model(attention_window=128, windowed_layers=0).attention_span is FULL_CAUSAL
    assert _model(attention_window=128, windowed_layers=1).attention_span == AttentionSpan(128, 0.25)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"windowed_layers": 2}, "needs model.attention_window"),
        ({"attention_window": 8, "windowed_layers": 5}, "model.windowed_layers=5: expected 0 to"),
        ({"attention_window": 0}, "model.attention_window=0"),
    ],
)
def test_bad_model_windows_are_refused(kw: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(**kw)


def test_gpu_token_stats_sum_the_span_pairs() -> None:
    lens = np.array([5, 300, 40, 129])
    gpu, mb = np.array([0, 0, 1, 1]), np.zeros(4, dtype=np.int64)
    span = AttentionSpan(128, 0.5)
    tokens, pairs = gpu_token_stats(lens, gpu, mb, 1, 2, span)
    p = span.pairs(lens)
    np.testing.assert_array_equal(tokens, [[305, 169]])
    np.testing.assert_allclose(pairs, [[p[0] + p[1], p[2] + p[3]]])


def test_balanced_layout_ranks_micro_batches_by_the_span_pairs() -> None:
    """LPT packs the bins {50, 10, 4} and {40, 24} (64 tokens each), then runs the bin of more attention
    pairs first: {50, 10, 4} under full causal attention (1340 pairs against 1120), {40, 24} under a window
    of 20 keys on every layer (875 against 900)."""
    tokens = np.array([50, 40, 24, 10, 4], dtype=np.int64)
    offsets = np.array([0, tokens.size])
    full = layout_samples(tokens, offsets, 1, samples_per_microbatch=3)
    windowed = layout_samples(tokens, offsets, 1, samples_per_microbatch=3, span=AttentionSpan(20, 1.0))
    assert full.sample_mb.tolist() == [0, 1, 1, 0, 0]
    assert windowed.sample_mb.tolist() == [1, 0, 0, 1, 1]


def _windowed(ctx):  # type: ignore[no-untyped-def]
    model = dataclasses.replace(ctx.model, attention_window=32, windowed_layers=ctx.model.num_layers // 2)
    return dataclasses.replace(ctx, model=model)


def test_pricing_sees_the_workloads_pairs() -> None:
    """Fairness: a plan that keeps the layout is priced on the same attention pairs the workload holds."""
    counts = make_counts(3, samples=48, layers=2, experts=8)
    span = AttentionSpan(16, 0.5)
    w = build_workload(counts, 4, samples_per_microbatch=2, span=span)
    full = build_workload(counts, 4, samples_per_microbatch=2)
    assert not np.allclose(w.causal_pairs, full.causal_pairs)  # the lengths (1-59) exceed the window
    ctx = _windowed(layer_ctx(1, 4, 8, num_layers=2, microbatches=2, samples_per_gpu=2, seed=1))
    placement = static_placement(2, 8, 4)
    plan = BatchPlan(
        home=placement,
        assign=home_assign(ctx.load, placement, 4),
        load=ctx.load,
        sample_gpu=ctx.sample_gpu,
    )
    priced = price_plan(plan, ctx, ctx.cost, placement)
    _, want = gpu_token_stats(
        ctx.sample_tokens, ctx.sample_gpu, ctx.sample_mb, ctx.num_microbatches, 4, ctx.model.attention_span
    )
    np.testing.assert_array_equal(priced.pairs, want)
    _, full_pairs = gpu_token_stats(ctx.sample_tokens, ctx.sample_gpu, ctx.sample_mb, ctx.num_microbatches, 4)
    assert (priced.pairs < full_pairs).all()
    attn = ctx.cost.attention_time(priced.tokens, want).max(axis=-1)
    np.testing.assert_array_equal(attention_window(ctx, ctx.sample_gpu), attn)


def test_locality_caps_the_span_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The locality round's attention cap is set on, and holds for, the model's own pairs (a windowed
    model): the hill climb is handed the span's per-sample pairs."""
    seen: list[np.ndarray] = []
    climb = locality._hill_climb

    def spy(gpu, tokens, pairs, *rest):  # type: ignore[no-untyped-def]
        seen.append(np.array(pairs))
        return climb(gpu, tokens, pairs, *rest)

    monkeypatch.setattr(locality, "_hill_climb", spy)
    tol = 0.1
    ctx = _windowed(layer_ctx(2, 4, 32, microbatches=3, samples_per_gpu=4, seed=3, alpha=0.2))
    home = np.stack([np.random.default_rng(l).permutation(np.repeat(np.arange(8), 4)) for l in range(2)])
    new_gpu, stats = locality_round(ctx, home.astype(np.int32), tolerance=tol)
    mb, g, span = ctx.num_microbatches, ctx.num_gpus, ctx.model.attention_span
    _, before = gpu_token_stats(ctx.sample_tokens, ctx.sample_gpu, ctx.sample_mb, mb, g, span)
    _, after = gpu_token_stats(ctx.sample_tokens, new_gpu, ctx.sample_mb, mb, g, span)
    cap = np.maximum(before.max(axis=1), (1 + tol) * before.mean(axis=1))
    assert (after.max(axis=1) <= cap * (1 + 1e-12)).all()
    assert stats["locality_moved_samples"] > 0
    want = span.pairs(ctx.sample_tokens)
    members = [np.flatnonzero(ctx.sample_mb == m) for m in range(mb)]
    assert len(seen) == mb
    for got, idx in zip(seen, members, strict=True):
        np.testing.assert_array_equal(got, want[idx])
