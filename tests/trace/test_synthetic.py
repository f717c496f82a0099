"""Synthetic RL workloads: determinism, the count invariants, lengths, presets and model shapes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from relibra.trace.synthetic import PRESETS, generate_counts, generate_trace, get_preset


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_counts_invariants(preset: str) -> None:
    counts = generate_counts(
        preset,
        num_experts=32,
        num_layers=4,
        top_k=4,
        num_batches=2,
        samples_per_batch=16,
        seed=1,
        max_tokens=512,
    )
    assert counts.counts.shape == (32, 4, 32) and counts.counts.dtype == np.int32
    # Conservation: every layer routes tokens * k slots; top-k is distinct, so no count exceeds tokens.
    assert np.all(counts.counts.sum(-1) == counts.tokens[:, None] * 4)
    assert np.all(counts.counts <= counts.tokens[:, None, None])
    assert np.all(counts.tokens <= 512) and np.all(counts.tokens >= 1)
    assert counts.batch_offsets.tolist() == [0, 16, 32]
    assert counts.sample_domain is not None
    assert set(np.unique(counts.sample_domain)) <= set(range(len(counts.domain_names)))


def test_deterministic_by_seed() -> None:
    a = generate_counts("mixed", 16, 3, 2, 2, 8, seed=7, max_tokens=256)
    b = generate_counts("mixed", 16, 3, 2, 2, 8, seed=7, max_tokens=256)
    c = generate_counts("mixed", 16, 3, 2, 2, 8, seed=8, max_tokens=256)
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.counts, c.counts)
    t1 = generate_trace("coding", 16, 3, 2, 1, 4, seed=3, max_tokens=64)
    t2 = generate_trace("coding", 16, 3, 2, 1, 4, seed=3, max_tokens=64)
    np.testing.assert_array_equal(t1.experts, t2.experts)


def test_top_k_equal_to_experts_is_a_full_route() -> None:
    counts = generate_counts("reasoning", 4, 2, 4, 1, 3, seed=0, max_tokens=50)
    assert np.all(counts.counts == counts.tokens[:, None, None])


def test_lengths_follow_the_preset() -> None:
    reasoning = generate_counts("reasoning", 8, 1, 2, 1, 400, seed=0)
    instruct = generate_counts("instruction_following", 8, 1, 2, 1, 400, seed=0)
    assert np.median(reasoning.tokens) > 3 * np.median(instruct.tokens)
    cap = get_preset("reasoning").domains[0].max_tokens
    assert reasoning.tokens.max() == cap, "long reasoning chains must hit the truncation length"
    assert np.mean(reasoning.tokens == cap) > 0.01


def test_trace_matches_counts_in_distribution() -> None:
    """Per-token routes (exact top-k) and direct counts (approximate) come from the same model."""
    trace = generate_trace("reasoning", 16, 2, 4, 1, 6, seed=5, max_tokens=400)
    direct = generate_counts("reasoning", 16, 2, 4, 1, 6, seed=5, max_tokens=400)
    from_trace = trace.to_counts()
    np.testing.assert_array_equal(from_trace.tokens, direct.tokens)  # same lengths for the same seed
    share_t = from_trace.counts.sum(0) / from_trace.counts.sum()
    share_c = direct.counts.sum(0) / direct.counts.sum()
    assert np.abs(share_t - share_c).max() < 0.02
    assert np.corrcoef(share_t.ravel(), share_c.ravel())[0, 1] > 0.95
    # Exact top-k: no repeated expert in a token.
    ordered = np.sort(trace.experts, axis=-1)
    assert not np.any(ordered[..., 1:] == ordered[..., :-1])


def test_hot_experts_shift_between_microbatches() -> None:
    """RL property: per-micro-batch loads differ far more than multinomial noise around the batch mean."""
    counts = generate_counts("reasoning", 64, 2, 8, 1, 64, seed=2, max_tokens=2048)
    mb = counts.counts.reshape(8, 8, 2, 64).sum(1).astype(float)  # 8 micro-batches of 8 samples
    share = mb / mb.sum(-1, keepdims=True)
    hot = share.argmax(-1)
    assert len(np.unique(hot[:, 0])) > 1 or len(np.unique(hot[:, 1])) > 1
    flat = dataclasses.replace(
        get_preset("reasoning"),
        domains=(dataclasses.replace(get_preset("reasoning").domains[0], affinity_sigma=0.0),),
    )
    calm = generate_counts(flat, 64, 2, 8, 1, 64, seed=2, max_tokens=2048)
    calm_mb = calm.counts.reshape(8, 8, 2, 64).sum(1).astype(float)
    calm_share = calm_mb / calm_mb.sum(-1, keepdims=True)
    assert share.std(0).mean() > 2 * calm_share.std(0).mean()


@pytest.mark.parametrize(("experts", "layers", "k"), [(128, 48, 8), (128, 45, 8), (128, 94, 8), (64, 16, 8)])
def test_model_shapes(experts: int, layers: int, k: int) -> None:
    counts = generate_counts("mixed", experts, layers, k, 1, 4, seed=0, max_tokens=64)
    assert counts.counts.shape == (4, layers, experts)
    assert counts.meta["num_experts"] == experts and counts.meta["top_k"] == k


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown workload preset"):
        generate_counts("pretraining", 8, 1, 2, 1, 1, seed=0)
    with pytest.raises(ValueError, match="top_k=9 exceeds"):
        generate_counts("mixed", 8, 1, 9, 1, 1, seed=0)
    with pytest.raises(ValueError, match="max_total_tokens"):
        generate_trace("reasoning", 8, 1, 2, 1, 4, seed=0, max_total_tokens=10)


@pytest.mark.slow
def test_paper_scale_is_fast_and_bounded() -> None:
    import time

    start = time.perf_counter()
    counts = generate_counts("reasoning", 128, 94, 8, 1, 512, seed=0, max_tokens=8192)
    assert time.perf_counter() - start < 30
    assert counts.counts.nbytes < 30e6
    assert np.all(counts.counts.sum(-1) == counts.tokens[:, None] * 8)


def _inclusion_reference(probs: np.ndarray, top_k: int) -> np.ndarray:
    """The water-filling as written before its fixed-point exit (commit 3d1757c): top_k rounds at most."""
    q = probs * top_k
    capped = np.zeros(q.shape, dtype=bool)
    for _ in range(top_k):
        capped |= q >= 1.0
        if not capped.any():
            break
        free_mass = np.where(capped, 0.0, probs).sum(axis=-1, keepdims=True)
        room = top_k - capped.sum(axis=-1, keepdims=True)
        scale = np.divide(room, free_mass, out=np.zeros_like(free_mass), where=free_mass > 0)
        q = np.where(capped, 1.0, probs * scale)
    return q


@pytest.mark.parametrize("top_k", [1, 2, 4, 8])
@pytest.mark.parametrize("alpha", [0.02, 0.2, 2.0])
def test_inclusion_stops_at_its_fixed_point_with_the_same_numbers(top_k: int, alpha: float) -> None:
    from relibra.trace.synthetic import _inclusion

    probs = np.random.default_rng(top_k).dirichlet(np.full(32, alpha), size=(40, 3))
    want = _inclusion_reference(probs, top_k)
    assert np.array_equal(_inclusion(probs, top_k), want)
    assert np.allclose(want.sum(axis=-1), top_k) and want.max() <= 1.0
