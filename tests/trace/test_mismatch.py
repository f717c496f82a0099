"""Trained routes with a share of every (sample, layer)'s slots re-drawn (relibra.trace.mismatch)."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.trace.mismatch import redrawn_slots, trained_counts
from relibra.types import SampleCounts


def hot_counts(
    samples: int = 24, layers: int = 3, experts: int = 16, k: int = 2, tokens: int = 400
) -> SampleCounts:
    """Sample ``s`` routes 3/4 of its slots to its own hot expert pair, the rest uniformly (two batches)."""
    rng = np.random.default_rng(7)
    c = np.zeros((samples, layers, experts), dtype=np.int32)
    for s in range(samples):
        hot = [(2 * s) % experts, (2 * s + 1) % experts]
        for layer in range(layers):
            c[s, layer, hot] = tokens * 3 // 4
            rest = rng.multinomial(tokens * k - 2 * (tokens * 3 // 4), np.full(experts, 1 / experts))
            c[s, layer] += rest.astype(np.int32)
    assert (c <= tokens).all()
    return SampleCounts(
        counts=c,
        tokens=np.full(samples, tokens, dtype=np.int64),
        batch_offsets=np.array([0, samples // 2, samples], dtype=np.int64),
        top_k=k,
    )


def test_zero_is_exact_replay() -> None:
    counts = hot_counts()
    assert trained_counts(counts, 0.0, seed=3) is counts


@pytest.mark.parametrize("mismatch", [0.05, 0.3, 1.0])
def test_slots_conserved_per_sample_and_layer_and_experts_distinct(mismatch: float) -> None:
    counts = hot_counts()
    out = trained_counts(counts, mismatch, seed=0)
    assert out.counts.dtype == np.int32 and out.counts.shape == counts.counts.shape
    np.testing.assert_array_equal(out.counts.sum(axis=-1), counts.counts.sum(axis=-1))
    assert (out.counts >= 0).all()
    assert (out.counts <= counts.tokens[:, None, None]).all()  # a token's k experts stay distinct
    np.testing.assert_array_equal(out.tokens, counts.tokens)
    np.testing.assert_array_equal(out.batch_offsets, counts.batch_offsets)
    assert out.meta["replay_mismatch"] == mismatch


def test_deterministic_in_the_seed() -> None:
    counts = hot_counts()
    a, b = trained_counts(counts, 0.2, seed=5), trained_counts(counts, 0.2, seed=5)
    np.testing.assert_array_equal(a.counts, b.counts)
    assert not np.array_equal(a.counts, trained_counts(counts, 0.2, seed=6).counts)


def test_redrawn_slots_is_the_rounded_share() -> None:
    np.testing.assert_array_equal(redrawn_slots(np.array([0, 10, 15, 800]), 0.1), [0, 1, 2, 80])
    np.testing.assert_array_equal(redrawn_slots(np.array([7]), 1.0), [7])
    for bad in (-0.01, 1.01, float("nan")):
        with pytest.raises(ValueError, match="mismatch"):
            trained_counts(hot_counts(), bad, seed=0)


@pytest.mark.parametrize("mismatch", [0.1, 0.5, 1.0])
def test_amount_moved_follows_the_setting(mismatch: float) -> None:
    """Re-drawn slots leave in proportion to each expert's count and arrive in proportion to the batch's
    popularity, so the count change is ``mismatch * slots * TV(sample share, popularity)`` up to sampling
    noise (the total variation distance: what leaves an expert and what arrives at it cancel in counts)."""
    counts = hot_counts(samples=40, tokens=2000)
    out = trained_counts(counts, mismatch, seed=1)
    moved = np.abs(out.counts.astype(np.int64) - counts.counts).sum(axis=-1) / 2  # [S, L]
    expected = np.zeros_like(moved)
    for b in range(counts.num_batches):
        sl = counts.batch(b)
        c = counts.counts[sl].astype(np.float64)
        popularity = c.sum(axis=0) / c.sum(axis=(0, 2))[:, None]  # [L, E]
        share = c / c.sum(axis=-1, keepdims=True)  # [Sb, L, E]
        expected[sl] = mismatch * c.sum(axis=-1) * 0.5 * np.abs(share - popularity).sum(axis=-1)
    assert moved.sum() == pytest.approx(expected.sum(), rel=0.05)
    # and the change is never more than the slots re-drawn
    assert (moved <= redrawn_slots(counts.counts.sum(axis=-1), mismatch)).all()


def test_redrawn_slots_follow_the_batch_popularity() -> None:
    """Every slot re-drawn (mismatch 1): each sample's counts become a draw of its batch's popularity."""
    counts = hot_counts(samples=40, tokens=2000)
    out = trained_counts(counts, 1.0, seed=2)
    for b in range(counts.num_batches):
        sl = counts.batch(b)
        popularity = counts.counts[sl].sum(axis=0) / counts.counts[sl].sum(axis=(0, 2))[:, None]
        drawn = out.counts[sl].sum(axis=0) / out.counts[sl].sum(axis=(0, 2))[:, None]
        np.testing.assert_allclose(drawn, popularity, atol=0.01)
        # a sample's own hot pair is no longer hot
        assert out.counts[sl].max() < counts.counts[sl].max() / 2
