"""Workload assembly: samples -> GPUs -> micro-batches -> loads ``x[m, l, j, e]``.

Glossary (DESIGN.md): ``S`` samples, ``B`` batches, ``G`` GPUs of the EP group, ``M`` micro-batches
(global index over all batches), ``Mb`` micro-batches of one batch, ``L`` MoE layers, ``E`` experts.

Three steps, each a plain function so that any of them can be replaced (reordering's second round, for
example, brings its own sample-to-GPU assignment):

1. :func:`balance_samples` spreads each batch's samples over the GPUs by tokens (LPT: longest sample
   first, onto the GPU holding the fewest tokens so far);
2. :func:`split_microbatches` cuts each GPU's samples into micro-batches, either ``K`` samples per GPU per
   micro-batch (``workload.samples_per_microbatch``) or by a per-GPU token budget
   (``workload.tokens_per_microbatch``). Micro-batches are synchronised across GPUs: every GPU runs its
   part of micro-batch ``m`` together, so a batch has as many micro-batches as its busiest GPU needs;
3. :func:`microbatch_loads` and :func:`gpu_token_stats` reduce per-sample counts to per-(micro-batch,
   GPU) loads with one sorted segment sum over flattened keys (no Python loop over tokens or samples).

:func:`layout_samples` runs steps 1 and 2; :func:`assemble` runs step 3 into a
:class:`~relibra.types.Workload`; :func:`build_workload` does everything from a
:class:`~relibra.types.SampleCounts`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from relibra.types import SampleCounts, Workload

__all__ = [
    "SampleLayout",
    "assemble",
    "balance_samples",
    "build_workload",
    "gpu_token_stats",
    "layout_samples",
    "microbatch_loads",
    "split_microbatches",
]


@dataclass(frozen=True)
class SampleLayout:
    """Where every sample runs: its GPU and its (global) micro-batch."""

    sample_gpu: np.ndarray
    """int32 [S]: GPU that processes sample ``s``."""
    sample_mb: np.ndarray
    """int32 [S]: global micro-batch index of sample ``s``."""
    mb_batch: np.ndarray
    """int32 [M]: batch of micro-batch ``m`` (non-decreasing)."""

    @property
    def num_microbatches(self) -> int:
        return int(self.mb_batch.shape[0])

    def local_mb(self) -> np.ndarray:
        """int32 [S]: micro-batch index of each sample local to its batch (0..Mb-1)."""
        first = np.searchsorted(self.mb_batch, self.mb_batch[self.sample_mb], side="left")
        return (self.sample_mb - first).astype(np.int32)


def _check_offsets(batch_offsets: np.ndarray, num_samples: int) -> np.ndarray:
    offsets = np.asarray(batch_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.shape[0] < 2:
        raise ValueError(f"batch_offsets must be 1-D with at least 2 entries, got shape {offsets.shape}")
    if offsets[0] != 0 or offsets[-1] != num_samples:
        raise ValueError(
            f"batch_offsets must start at 0 and end at the sample count {num_samples}, "
            f"got {offsets[0]}..{offsets[-1]}"
        )
    if np.any(np.diff(offsets) <= 0):
        raise ValueError("batch_offsets must be strictly increasing (every batch needs at least one sample)")
    return offsets


def _check_tokens(sample_tokens: np.ndarray) -> np.ndarray:
    tokens = np.asarray(sample_tokens, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"sample_tokens must be 1-D [S], got shape {tokens.shape}")
    if np.any(tokens < 0):
        raise ValueError("sample_tokens must be non-negative")
    return tokens


def balance_samples(sample_tokens: np.ndarray, batch_offsets: np.ndarray, num_gpus: int) -> np.ndarray:
    """Spread each batch's samples over the GPUs by tokens (LPT, ties to the lower GPU index).

    Args:
        sample_tokens: int64 [S] tokens of each sample.
        batch_offsets: int64 [B + 1] sample offsets of the batches.
        num_gpus: ``G``.
    Returns:
        int32 [S]: GPU of each sample.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    tokens = _check_tokens(sample_tokens)
    offsets = _check_offsets(batch_offsets, tokens.shape[0])
    sample_gpu = np.empty(tokens.shape[0], dtype=np.int32)
    for b in range(offsets.shape[0] - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        # NOTE: stable sort on -tokens keeps equal-length samples in their original order (determinism).
        order = lo + np.argsort(-tokens[lo:hi], kind="stable")
        heap = [(0, g) for g in range(num_gpus)]
        for s in order:
            held, g = heapq.heappop(heap)
            sample_gpu[s] = g
            heapq.heappush(heap, (held + int(tokens[s]), g))
    return sample_gpu


def _local_microbatches(
    tokens: np.ndarray,
    gpu_key: np.ndarray,
    samples_per_microbatch: int | None,
    tokens_per_microbatch: int | None,
) -> np.ndarray:
    """int64 [S]: micro-batch of each sample local to its (batch, GPU) group ``gpu_key``.

    Samples keep their original order within a group.
    """
    num = tokens.shape[0]
    order = np.argsort(gpu_key, kind="stable")
    sorted_key = gpu_key[order]
    starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]]) if num else np.zeros(0, int)
    group_start = np.repeat(starts, np.diff(np.r_[starts, num]))
    rank = np.arange(num) - group_start
    local = np.empty(num, dtype=np.int64)
    if tokens_per_microbatch is None:
        k = samples_per_microbatch if samples_per_microbatch is not None else max(num, 1)
        local[order] = rank // k
        return local
    # Token budget: greedy sequential packing within each group; a sample longer than the budget gets a
    # micro-batch of its own. Sequential by nature, but over samples only (hundreds per batch).
    budget = int(tokens_per_microbatch)
    sorted_tokens = tokens[order]
    mb = 0
    used = 0
    for i in range(num):
        if rank[i] == 0:
            mb, used = 0, 0
        t = int(sorted_tokens[i])
        if used > 0 and used + t > budget:
            mb, used = mb + 1, 0
        used += t
        local[order[i]] = mb
    return local


def split_microbatches(
    sample_tokens: np.ndarray,
    batch_offsets: np.ndarray,
    sample_gpu: np.ndarray,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> SampleLayout:
    """Cut each GPU's samples into micro-batches synchronised across GPUs.

    Args:
        sample_tokens: int64 [S] tokens of each sample.
        batch_offsets: int64 [B + 1] sample offsets of the batches.
        sample_gpu: int [S] GPU of each sample (any assignment, e.g. :func:`balance_samples`).
        num_gpus: ``G``.
        samples_per_microbatch: ``K`` samples per GPU per micro-batch; or
        tokens_per_microbatch: a per-GPU token budget per micro-batch. At most one of the two; with
            neither, each GPU runs all its samples of a batch as one micro-batch.
    Returns:
        The :class:`SampleLayout`; batch ``b`` has ``max_g`` (micro-batches GPU ``g`` needs) micro-batches.
    """
    if samples_per_microbatch is not None and tokens_per_microbatch is not None:
        raise ValueError(
            "give samples_per_microbatch or tokens_per_microbatch, not both "
            f"(got {samples_per_microbatch} and {tokens_per_microbatch})"
        )
    if samples_per_microbatch is not None and samples_per_microbatch < 1:
        raise ValueError(f"samples_per_microbatch must be >= 1, got {samples_per_microbatch}")
    if tokens_per_microbatch is not None and tokens_per_microbatch < 1:
        raise ValueError(f"tokens_per_microbatch must be >= 1, got {tokens_per_microbatch}")
    tokens = _check_tokens(sample_tokens)
    offsets = _check_offsets(batch_offsets, tokens.shape[0])
    gpu = np.asarray(sample_gpu)
    if gpu.shape != tokens.shape:
        raise ValueError(f"sample_gpu must have shape {tokens.shape} like sample_tokens, got {gpu.shape}")
    if gpu.size and (gpu.min() < 0 or gpu.max() >= num_gpus):
        raise ValueError(f"sample_gpu must lie in [0, {num_gpus}), got {gpu.min()}..{gpu.max()}")
    num_batches = offsets.shape[0] - 1
    sample_batch = np.repeat(np.arange(num_batches), np.diff(offsets))
    local = _local_microbatches(
        tokens, sample_batch * num_gpus + gpu, samples_per_microbatch, tokens_per_microbatch
    )
    # Step 2: synchronise across GPUs: batch b has max over its samples of (local + 1) micro-batches.
    per_batch = np.zeros(num_batches, dtype=np.int64)
    np.maximum.at(per_batch, sample_batch, local + 1)
    first_mb = np.r_[0, np.cumsum(per_batch)]
    return SampleLayout(
        sample_gpu=gpu.astype(np.int32),
        sample_mb=(first_mb[sample_batch] + local).astype(np.int32),
        mb_batch=np.repeat(np.arange(num_batches), per_batch).astype(np.int32),
    )


def layout_samples(
    sample_tokens: np.ndarray,
    batch_offsets: np.ndarray,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> SampleLayout:
    """Balance samples over GPUs by tokens (LPT) per batch, then cut micro-batches (see module doc).

    Args:
        sample_tokens: int64 [S]; batch_offsets: int64 [B + 1]; num_gpus: ``G``;
        samples_per_microbatch / tokens_per_microbatch: see :func:`split_microbatches`.
    Returns:
        :class:`SampleLayout` with sample_gpu int32 [S], sample_mb int32 [S], mb_batch int32 [M].
    """
    sample_gpu = balance_samples(sample_tokens, batch_offsets, num_gpus)
    return split_microbatches(
        sample_tokens, batch_offsets, sample_gpu, num_gpus, samples_per_microbatch, tokens_per_microbatch
    )


def _group_keys(
    sample_gpu: np.ndarray, sample_mb: np.ndarray, num_microbatches: int, num_gpus: int
) -> np.ndarray:
    gpu = np.asarray(sample_gpu, dtype=np.int64)
    mb = np.asarray(sample_mb, dtype=np.int64)
    if gpu.shape != mb.shape or gpu.ndim != 1:
        raise ValueError(f"sample_gpu and sample_mb must both be 1-D [S], got {gpu.shape} and {mb.shape}")
    if gpu.size and (gpu.min() < 0 or gpu.max() >= num_gpus):
        raise ValueError(f"sample_gpu must lie in [0, {num_gpus}), got {gpu.min()}..{gpu.max()}")
    if mb.size and (mb.min() < 0 or mb.max() >= num_microbatches):
        raise ValueError(f"sample_mb must lie in [0, {num_microbatches}), got {mb.min()}..{mb.max()}")
    return mb * num_gpus + gpu


def microbatch_loads(
    counts: np.ndarray,
    sample_gpu: np.ndarray,
    sample_mb: np.ndarray,
    num_microbatches: int,
    num_gpus: int,
) -> np.ndarray:
    """Loads ``x[m, l, j, e]``: the per-sample counts summed per (micro-batch, source GPU).

    Args:
        counts: int [S', L, E] per-sample expert counts.
        sample_gpu: int [S'] GPU of each sample.
        sample_mb: int [S'] micro-batch of each sample in ``[0, num_microbatches)`` (local or global).
        num_microbatches: ``Mb``; num_gpus: ``G``.
    Returns:
        int32 [Mb, L, G, E].
    """
    counts = np.asarray(counts)
    if counts.ndim != 3:
        raise ValueError(f"counts must be [S, L, E], got shape {counts.shape}")
    keys = _group_keys(sample_gpu, sample_mb, num_microbatches, num_gpus)
    if keys.shape[0] != counts.shape[0]:
        raise ValueError(f"counts has {counts.shape[0]} samples but sample_gpu has {keys.shape[0]}")
    _, num_layers, num_experts = counts.shape
    out = np.zeros((num_microbatches * num_gpus, num_layers * num_experts), dtype=np.int64)
    if keys.size:
        # One segment sum over samples sorted by their flattened (micro-batch, GPU) key.
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        flat = counts.reshape(counts.shape[0], -1)[order].astype(np.int64, copy=False)
        out[sorted_keys[starts]] = np.add.reduceat(flat, starts, axis=0)
    if out.size and out.max() > np.iinfo(np.int32).max:
        raise OverflowError("a load exceeds int32; use smaller micro-batches")
    load = out.astype(np.int32).reshape(num_microbatches, num_gpus, num_layers, num_experts)
    return np.ascontiguousarray(load.transpose(0, 2, 1, 3))


def gpu_token_stats(
    sample_tokens: np.ndarray,
    sample_gpu: np.ndarray,
    sample_mb: np.ndarray,
    num_microbatches: int,
    num_gpus: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and causal attention pairs each GPU holds in each micro-batch.

    Args:
        sample_tokens: int [S']; sample_gpu: int [S']; sample_mb: int [S'] in ``[0, num_microbatches)``.
    Returns:
        tokens int64 [Mb, G]; causal_pairs float64 [Mb, G] (sum over samples of ``len * (len + 1) / 2``).
    """
    lens = np.asarray(sample_tokens, dtype=np.int64)
    keys = _group_keys(sample_gpu, sample_mb, num_microbatches, num_gpus)
    if keys.shape != lens.shape:
        raise ValueError(f"sample_tokens has shape {lens.shape} but sample_gpu has {keys.shape}")
    size = num_microbatches * num_gpus
    tokens = np.zeros(size, dtype=np.int64)
    np.add.at(tokens, keys, lens)
    pairs = np.bincount(keys, weights=lens * (lens + 1) / 2.0, minlength=size)
    return tokens.reshape(num_microbatches, num_gpus), pairs.reshape(num_microbatches, num_gpus)


def assemble(counts: SampleCounts, layout: SampleLayout, num_gpus: int) -> Workload:
    """Loads of every micro-batch of every batch under ``layout``.

    Args:
        counts: per-sample counts (``counts.counts`` int32 [S, L, E]).
        layout: where each sample runs (from :func:`layout_samples` or a planner's reassignment).
        num_gpus: ``G``.
    Returns:
        :class:`~relibra.types.Workload` with load int32 [M, L, G, E], tokens int64 [M, G], causal_pairs
        float64 [M, G] and the layout's arrays.
    """
    if layout.sample_gpu.shape[0] != counts.num_samples:
        raise ValueError(
            f"layout covers {layout.sample_gpu.shape[0]} samples but counts has {counts.num_samples}"
        )
    num_mb = layout.num_microbatches
    sample_batch = np.repeat(np.arange(counts.num_batches), np.diff(counts.batch_offsets))
    if num_mb and not np.array_equal(layout.mb_batch[layout.sample_mb], sample_batch):
        raise ValueError("layout.sample_mb puts a sample into a micro-batch of another batch")
    load = microbatch_loads(counts.counts, layout.sample_gpu, layout.sample_mb, num_mb, num_gpus)
    tokens, pairs = gpu_token_stats(counts.tokens, layout.sample_gpu, layout.sample_mb, num_mb, num_gpus)
    return Workload(
        load=load,
        tokens=tokens,
        causal_pairs=pairs,
        sample_gpu=layout.sample_gpu,
        sample_mb=layout.sample_mb,
        mb_batch=layout.mb_batch,
        top_k=counts.top_k,
    )


def build_workload(
    counts: SampleCounts,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> Workload:
    """:func:`layout_samples` then :func:`assemble`: per-sample counts to a :class:`Workload`."""
    layout = layout_samples(
        counts.tokens, counts.batch_offsets, num_gpus, samples_per_microbatch, tokens_per_microbatch
    )
    return assemble(counts, layout, num_gpus)
