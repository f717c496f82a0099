"""Workload assembly: LPT balance, synchronised micro-batches, load conservation, against a plain loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.layout import (
    LAYOUTS,
    SampleLayout,
    balance_samples,
    layout_samples,
    microbatch_balance,
    split_microbatches,
    unbalanceable_batches,
)
from relibra.types import SampleCounts
from relibra.workload import assemble, build_workload, gpu_token_stats, microbatch_loads


def make_counts(
    seed: int, samples: int = 40, layers: int = 3, experts: int = 8, k: int = 2, batches: int = 2
) -> SampleCounts:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 60, size=samples).astype(np.int64)
    counts = np.stack([rng.multinomial(t * k, np.ones(experts) / experts, size=layers) for t in tokens])
    cuts = np.linspace(0, samples, batches + 1).astype(np.int64)
    return SampleCounts(counts=counts.astype(np.int32), tokens=tokens, batch_offsets=cuts, top_k=k)


def test_lpt_balances_tokens() -> None:
    tokens = np.array([7, 5, 4, 3, 3, 2], dtype=np.int64)
    gpu = balance_samples(tokens, np.array([0, 6]), 2)
    # LPT: 7->0, 5->1, 4->1, 3->0, 3->0? (0 holds 10, 1 holds 9) -> 3->1, 2->0
    per_gpu = np.bincount(gpu, weights=tokens, minlength=2)
    assert per_gpu.tolist() == [12.0, 12.0]


def test_lpt_is_per_batch() -> None:
    tokens = np.array([10, 1, 1, 10], dtype=np.int64)
    gpu = balance_samples(tokens, np.array([0, 2, 4]), 2)
    assert gpu[0] != gpu[1] and gpu[2] != gpu[3]


def test_samples_per_microbatch_layout() -> None:
    tokens = np.ones(10, dtype=np.int64)
    layout = layout_samples(
        tokens, np.array([0, 6, 10]), num_gpus=2, samples_per_microbatch=2, layout="contiguous"
    )
    # Batch 0: 3 samples per GPU -> 2 micro-batches; batch 1: 2 per GPU -> 1 micro-batch.
    assert layout.mb_batch.tolist() == [0, 0, 1]
    for m in range(3):
        for g in range(2):
            assert np.sum((layout.sample_mb == m) & (layout.sample_gpu == g)) <= 2
    assert layout.local_mb().tolist() == [int(x) - (2 if x == 2 else 0) for x in layout.sample_mb]


def test_token_budget_layout() -> None:
    tokens = np.array([5, 5, 5, 20, 1], dtype=np.int64)
    gpu = np.zeros(5, dtype=np.int32)
    layout = split_microbatches(tokens, np.array([0, 5]), gpu, 1, tokens_per_microbatch=10)
    # [5,5] | [5] | [20] (alone: longer than the budget) | [1]
    assert layout.sample_mb.tolist() == [0, 0, 1, 2, 3]
    per_mb = np.bincount(layout.sample_mb, weights=tokens)
    assert np.all((per_mb <= 10) | (np.bincount(layout.sample_mb) == 1))


def test_microbatches_are_synchronised() -> None:
    tokens = np.array([1, 1, 1, 1, 100], dtype=np.int64)
    layout = layout_samples(
        tokens, np.array([0, 5]), num_gpus=2, samples_per_microbatch=1, layout="contiguous"
    )
    # GPU with the long sample has 1 sample, the other 4 -> 4 micro-batches for everyone.
    assert layout.num_microbatches == 4
    # Balanced: ceil(5 / (2 * 1)) = 3 micro-batches wanted, at most 5 // 2 = 2 so every GPU gets a sample.
    balanced = layout_samples(tokens, np.array([0, 5]), num_gpus=2, samples_per_microbatch=1)
    assert balanced.num_microbatches == 2


def test_balanced_layout_evens_tokens_per_microbatch() -> None:
    # 8 samples, 2 GPUs, 2 micro-batches: bins of 10 tokens each are possible (9+1, 8+2, 7+3, 6+4).
    tokens = np.array([9, 1, 8, 2, 7, 3, 6, 4], dtype=np.int64)
    layout = layout_samples(tokens, np.array([0, 8]), num_gpus=2, samples_per_microbatch=2)
    per, _ = gpu_token_stats(tokens, layout.sample_gpu, layout.sample_mb, layout.num_microbatches, 2)
    assert per.tolist() == [[10, 10], [10, 10]]
    assert microbatch_balance(per).tolist() == [1.0, 1.0]


def test_balanced_layout_groups_by_attention_work() -> None:
    # Equal tokens per bin (6), but bins [6] and [3, 3] differ in causal pairs: the two single-sample bins
    # share a micro-batch, so every micro-batch's GPUs hold equal attention work too.
    tokens = np.array([6, 6, 3, 3, 3, 3], dtype=np.int64)
    layout = layout_samples(tokens, np.array([0, 6]), num_gpus=2, samples_per_microbatch=2)
    assert layout.num_microbatches == 2
    _, pairs = gpu_token_stats(tokens, layout.sample_gpu, layout.sample_mb, 2, 2)
    assert np.all(pairs[:, 0] == pairs[:, 1])


def test_token_budget_sizes_balanced_microbatches() -> None:
    tokens = np.full(16, 10, dtype=np.int64)
    layout = layout_samples(tokens, np.array([0, 16]), num_gpus=4, tokens_per_microbatch=20)
    assert layout.num_microbatches == 2  # 160 tokens / (4 GPUs * 20)
    per, _ = gpu_token_stats(tokens, layout.sample_gpu, layout.sample_mb, 2, 4)
    assert np.all(per == 20)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_gpus=st.integers(1, 8),
    k=st.sampled_from([None, 1, 2, 3]),
    samples=st.integers(1, 60),
)
def test_balanced_layout_fills_every_gpu(seed: int, num_gpus: int, k: int | None, samples: int) -> None:
    tokens = np.random.default_rng(seed).integers(1, 500, size=samples).astype(np.int64)
    layout = layout_samples(tokens, np.array([0, samples]), num_gpus, samples_per_microbatch=k)
    mb = layout.num_microbatches
    want = 1 if k is None else -(-samples // (num_gpus * k))
    assert mb == max(1, min(want, samples // num_gpus))
    per, _ = gpu_token_stats(tokens, layout.sample_gpu, layout.sample_mb, mb, num_gpus)
    assert per.sum() == tokens.sum()
    assert (np.all(per > 0)) == (samples >= num_gpus)
    assert unbalanceable_batches(np.array([0, samples]), num_gpus) == int(samples < num_gpus)
    # LPT into bins: no bin exceeds the mean bin by more than the longest sample
    assert per.max() <= per.sum() / (mb * num_gpus) + tokens.max()


@pytest.mark.parametrize("preset", ["reasoning", "instruction_following", "coding", "mixed"])
def test_balanced_layout_balances_every_preset(preset: str) -> None:
    """The synthetic presets at EP 16 (256 rollouts, 2 per GPU per micro-batch): every micro-batch's
    per-GPU tokens stay near their mean with the balanced layout, not with the contiguous one."""
    from relibra.trace.synthetic import generate_counts

    counts = generate_counts(preset, 16, 1, 2, num_batches=1, samples_per_batch=256, seed=3, max_tokens=8192)
    ratios = {}
    for layout in LAYOUTS:
        work = build_workload(counts, 16, samples_per_microbatch=2, layout=layout)
        ratios[layout] = microbatch_balance(work.tokens)
    assert np.median(ratios["balanced"]) < 1.1
    assert np.median(ratios["balanced"]) < np.median(ratios["contiguous"])
    assert np.percentile(ratios["balanced"], 90) <= np.percentile(ratios["contiguous"], 90)


def test_unknown_layout_is_refused() -> None:
    with pytest.raises(ValueError, match=r"workload\.layout"):
        layout_samples(np.ones(4, dtype=np.int64), np.array([0, 4]), 2, layout="packed")


def test_bad_arguments() -> None:
    tokens = np.ones(4, dtype=np.int64)
    with pytest.raises(ValueError, match="not both"):
        layout_samples(tokens, np.array([0, 4]), 2, samples_per_microbatch=1, tokens_per_microbatch=4)
    with pytest.raises(ValueError, match="batch_offsets"):
        layout_samples(tokens, np.array([0, 3]), 2)
    with pytest.raises(ValueError, match="strictly increasing"):
        layout_samples(tokens, np.array([0, 0, 4]), 2)
    with pytest.raises(ValueError, match="sample_gpu must lie"):
        split_microbatches(tokens, np.array([0, 4]), np.array([0, 1, 2, 3]), 2)
    with pytest.raises(ValueError, match="sample_mb must lie"):
        microbatch_loads(np.ones((4, 1, 2), np.int32), np.zeros(4, int), np.arange(4), 2, 1)


def loop_loads(counts: np.ndarray, gpu: np.ndarray, mb: np.ndarray, num_mb: int, num_g: int) -> np.ndarray:
    out = np.zeros((num_mb, counts.shape[1], num_g, counts.shape[2]), dtype=np.int64)
    for s in range(counts.shape[0]):
        out[mb[s], :, gpu[s], :] += counts[s]
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), num_gpus=st.integers(1, 6), k=st.sampled_from([None, 1, 3]))
def test_loads_match_a_loop_and_conserve_tokens(seed: int, num_gpus: int, k: int | None) -> None:
    counts = make_counts(seed)
    work = build_workload(counts, num_gpus, samples_per_microbatch=k)
    expected = loop_loads(counts.counts, work.sample_gpu, work.sample_mb, work.num_microbatches, num_gpus)
    np.testing.assert_array_equal(work.load, expected)
    assert work.load.dtype == np.int32
    # Conservation: sum over GPUs and experts == tokens * k, per micro-batch and layer.
    per_mb_tokens = np.bincount(work.sample_mb, weights=counts.tokens, minlength=work.num_microbatches)
    assert np.all(work.load.sum(axis=(2, 3)) == (per_mb_tokens * counts.top_k)[:, None])
    np.testing.assert_array_equal(work.tokens.sum(axis=1), per_mb_tokens)
    assert np.all(np.diff(work.mb_batch) >= 0)


def test_gpu_token_stats() -> None:
    tokens, pairs = gpu_token_stats(np.array([3, 4, 2]), np.array([0, 1, 0]), np.array([0, 0, 1]), 2, 2)
    assert tokens.tolist() == [[3, 4], [2, 0]]
    assert pairs.tolist() == [[6.0, 10.0], [3.0, 0.0]]


def test_local_indices_per_batch() -> None:
    counts = make_counts(1, batches=3)
    work = build_workload(counts, 4, samples_per_microbatch=2)
    for b in range(counts.num_batches):
        sl = counts.batch(b)
        mbs = work.batch_microbatches(b)
        local = work.sample_mb[sl] - mbs[0]
        load_b = microbatch_loads(counts.counts[sl], work.sample_gpu[sl], local, len(mbs), 4)
        np.testing.assert_array_equal(load_b, work.load[mbs])


def test_assemble_refuses_cross_batch_layout() -> None:
    counts = make_counts(2, samples=4, batches=2)
    bad = SampleLayout(
        sample_gpu=np.zeros(4, np.int32),
        sample_mb=np.array([0, 1, 0, 1], np.int32),
        mb_batch=np.array([0, 1], np.int32),
    )
    with pytest.raises(ValueError, match="another batch"):
        assemble(counts, bad, 1)
