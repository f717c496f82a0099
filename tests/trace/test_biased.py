"""Routing of known skew (relibra/trace/biased.py)."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.trace.biased import force_biased_shares, popularity_counts
from relibra.types import SampleCounts


def _blank(
    samples: int = 6, layers: int = 3, experts: int = 16, tokens: int = 2000, k: int = 4
) -> SampleCounts:
    return SampleCounts(
        counts=np.zeros((samples, layers, experts), dtype=np.int32),
        tokens=np.full(samples, tokens, dtype=np.int64),
        batch_offsets=np.array([0, samples], dtype=np.int64),
        top_k=k,
        meta={},
    )


def test_force_biased_shares_grow_more_skewed_with_the_bias() -> None:
    flat = force_biased_shares(4, 16, 4, 0.0, seed=1, tokens=20000)
    assert np.allclose(flat.sum(axis=1), 1.0)
    assert np.abs(flat - 1 / 16).max() < 0.01  # std 0: uniform, up to Monte-Carlo error
    peaks = [
        force_biased_shares(4, 16, 4, std, seed=1, tokens=20000).max(axis=1).mean()
        for std in (0.25, 0.5, 1.0)
    ]
    assert peaks[0] < peaks[1] < peaks[2]
    # an expert is in at most every token's top-k: its share of the k slots is at most 1 / k
    assert force_biased_shares(4, 16, 4, 5.0, seed=1, tokens=20000).max() <= 1 / 4 + 1e-12


def test_force_biased_refuses_bad_settings() -> None:
    with pytest.raises(ValueError, match="std"):
        force_biased_shares(2, 8, 2, -1.0, seed=0)
    with pytest.raises(ValueError, match="top_k"):
        force_biased_shares(2, 8, 9, 1.0, seed=0)


def test_popularity_counts_conserve_slots_and_follow_the_shares() -> None:
    blank = _blank()
    shares = np.tile(np.linspace(1.0, 3.0, 16), (3, 1))
    shares /= shares.sum(axis=1, keepdims=True)
    routed = popularity_counts(blank, shares, seed=3, name="test")
    c = routed.counts
    assert c.shape == blank.counts.shape and c.dtype == np.int32
    assert (c.sum(axis=2) == 2000 * 4).all() and (c <= 2000).all()
    observed = c.sum(axis=0) / c.sum(axis=(0, 2))[:, None]
    assert np.abs(observed - shares).max() < 0.01
    assert routed.meta["routing"] == "test"
    assert (popularity_counts(blank, shares, seed=3, name="test").counts == c).all()  # seeded


def test_popularity_counts_refuse_bad_shares() -> None:
    blank = _blank()
    with pytest.raises(ValueError, match="shape"):
        popularity_counts(blank, np.full((2, 16), 1 / 16), seed=0, name="x")
    bad = np.full((3, 16), 1 / 16)
    bad[0, 0] = -0.1
    with pytest.raises(ValueError, match="non-negative"):
        popularity_counts(blank, bad, seed=0, name="x")
