"""The sample layout (``workload.layout``): which GPU and micro-batch every sample of a batch runs on.

The **layout** (``workload.layout``) decides where every sample runs; it is one stage every planner
shares (a planner may move samples afterwards only if its method says so: ReLibra's locality round).

* ``balanced`` (default), :func:`balanced_layout`: what RL trainers do (verl's dynamic batch size with
  sequence balancing, ``rearrange_micro_batches`` / ``get_seqlen_balanced_partitions``; NeMo-RL's dynamic
  batching; Megatron's sequence packing): the batch's samples are packed into ``Mb * G`` bins of nearly
  equal tokens (LPT: longest sample first into the bin holding the fewest tokens, ties to the fewest causal
  attention pairs), then the bins are grouped ``G`` at a time into micro-batches in order of their
  attention work (the pairs of :mod:`relibra.attention_span`, ``sum len * (len + 1) / 2`` under full
  causal attention: the second key), so that the ``G`` GPUs of every
  micro-batch hold nearly the same tokens and nearly the same attention work. Within a micro-batch the
  heaviest bin goes to the GPU with the fewest tokens so far in the batch. ``Mb`` comes from the sizing
  keys: ``ceil(Sb / (G * K))`` for ``workload.samples_per_microbatch = K``, ``ceil(tokens / (G * budget))``
  for ``workload.tokens_per_microbatch = budget`` (a bin may exceed the budget by less than its last
  sample), and never more than ``Sb // G`` so that every GPU gets a sample in every micro-batch. A batch
  with fewer samples than GPUs cannot be balanced: it runs as one micro-batch with idle GPUs and is
  counted (:func:`unbalanceable_batches`, the ``unbalanceable_batches`` result column).
* ``contiguous``: the suite's former layout: :func:`balance_samples` spreads each batch's samples over the
  GPUs by tokens over the whole batch (LPT), then :func:`split_microbatches` cuts each GPU's samples into
  micro-batches in sample order, ``K`` samples or a token budget per GPU per micro-batch. Micro-batches are
  synchronised across GPUs, so a batch has as many micro-batches as its busiest GPU needs; one
  micro-batch's per-GPU tokens are not balanced (a median max/mean near 2 on reasoning batches).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from relibra.attention_span import FULL_CAUSAL, AttentionSpan

LAYOUTS = ("balanced", "contiguous")
"""Values of ``workload.layout`` (module doc); the first is the default."""


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
    _check_sizing(samples_per_microbatch, tokens_per_microbatch)
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


def _check_sizing(samples_per_microbatch: int | None, tokens_per_microbatch: int | None) -> None:
    if samples_per_microbatch is not None and tokens_per_microbatch is not None:
        raise ValueError(
            "give samples_per_microbatch or tokens_per_microbatch, not both "
            f"(got {samples_per_microbatch} and {tokens_per_microbatch})"
        )
    if samples_per_microbatch is not None and samples_per_microbatch < 1:
        raise ValueError(f"samples_per_microbatch must be >= 1, got {samples_per_microbatch}")
    if tokens_per_microbatch is not None and tokens_per_microbatch < 1:
        raise ValueError(f"tokens_per_microbatch must be >= 1, got {tokens_per_microbatch}")


def _balanced_batch(
    tokens: np.ndarray, num_gpus: int, num_mb: int, span: AttentionSpan
) -> tuple[np.ndarray, np.ndarray]:
    """One batch's balanced layout: tokens int64 [Sb] -> (gpu int32 [Sb], local micro-batch int64 [Sb])."""
    sb = tokens.shape[0]
    pairs = span.pairs(tokens)
    num_bins = num_mb * num_gpus
    # Step 1: LPT into Mb * G bins by tokens, ties to the bin with the fewest attention pairs.
    order = np.argsort(-tokens, kind="stable")
    heap = [(0, 0.0, b) for b in range(num_bins)]
    sample_bin = np.empty(sb, dtype=np.int64)
    for s in order:
        held, held_pairs, b = heapq.heappop(heap)
        sample_bin[s] = b
        heapq.heappush(heap, (held + int(tokens[s]), held_pairs + float(pairs[s]), b))
    bin_tokens = np.bincount(sample_bin, weights=tokens, minlength=num_bins)
    bin_pairs = np.bincount(sample_bin, weights=pairs, minlength=num_bins)
    # Step 2: G bins per micro-batch, in order of attention work (then tokens), heaviest first.
    ranked = np.lexsort((-bin_tokens, -bin_pairs))  # [Mb * G]
    bin_mb = np.empty(num_bins, dtype=np.int64)
    bin_mb[ranked] = np.arange(num_bins) // num_gpus
    # Step 3: within each micro-batch, the heaviest bin to the GPU with the fewest tokens so far.
    bin_gpu = np.empty(num_bins, dtype=np.int64)
    so_far = np.zeros(num_gpus)
    for m in range(num_mb):
        members = ranked[m * num_gpus : (m + 1) * num_gpus]
        heavy_first = members[np.argsort(-bin_tokens[members], kind="stable")]
        light_first = np.argsort(so_far, kind="stable")
        bin_gpu[heavy_first] = light_first
        so_far[light_first] += bin_tokens[heavy_first]
    return bin_gpu[sample_bin].astype(np.int32), bin_mb[sample_bin]


def _balanced_microbatches(
    tokens: np.ndarray, num_gpus: int, samples_per_microbatch: int | None, tokens_per_microbatch: int | None
) -> int:
    """``Mb`` of one batch under the balanced layout (module doc); tokens int64 [Sb]."""
    sb = tokens.shape[0]
    if tokens_per_microbatch is not None:
        want = -(-int(tokens.sum()) // (num_gpus * int(tokens_per_microbatch)))
    elif samples_per_microbatch is not None:
        want = -(-sb // (num_gpus * int(samples_per_microbatch)))
    else:
        want = 1
    return max(1, min(want, sb // num_gpus))


def balanced_layout(
    sample_tokens: np.ndarray,
    batch_offsets: np.ndarray,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    span: AttentionSpan = FULL_CAUSAL,
) -> SampleLayout:
    """Micro-batches whose GPUs hold nearly equal tokens and attention work (module doc, ``balanced``).

    Args:
        sample_tokens: int64 [S]; batch_offsets: int64 [B + 1]; num_gpus: ``G``;
        samples_per_microbatch / tokens_per_microbatch: size micro-batches (at most one; neither: one
            micro-batch per batch); span: the model's attention span (the second key).
    Returns:
        :class:`SampleLayout` with sample_gpu int32 [S], sample_mb int32 [S], mb_batch int32 [M].
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    _check_sizing(samples_per_microbatch, tokens_per_microbatch)
    tokens = _check_tokens(sample_tokens)
    offsets = _check_offsets(batch_offsets, tokens.shape[0])
    num_batches = offsets.shape[0] - 1
    sample_gpu = np.empty(tokens.shape[0], dtype=np.int32)
    sample_mb = np.empty(tokens.shape[0], dtype=np.int32)
    per_batch = np.empty(num_batches, dtype=np.int64)
    first = 0
    for b in range(num_batches):
        sl = slice(int(offsets[b]), int(offsets[b + 1]))
        mb = _balanced_microbatches(tokens[sl], num_gpus, samples_per_microbatch, tokens_per_microbatch)
        gpu, local = _balanced_batch(tokens[sl], num_gpus, mb, span)
        sample_gpu[sl] = gpu
        sample_mb[sl] = first + local
        per_batch[b] = mb
        first += mb
    return SampleLayout(
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        mb_batch=np.repeat(np.arange(num_batches), per_batch).astype(np.int32),
    )


def contiguous_layout(
    sample_tokens: np.ndarray,
    batch_offsets: np.ndarray,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    span: AttentionSpan = FULL_CAUSAL,
) -> SampleLayout:
    """:func:`balance_samples` over the batch, then :func:`split_microbatches` in sample order (by tokens
    alone: ``span`` is not read)."""
    sample_gpu = balance_samples(sample_tokens, batch_offsets, num_gpus)
    return split_microbatches(
        sample_tokens, batch_offsets, sample_gpu, num_gpus, samples_per_microbatch, tokens_per_microbatch
    )


def layout_samples(
    sample_tokens: np.ndarray,
    batch_offsets: np.ndarray,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    layout: str = LAYOUTS[0],
    span: AttentionSpan = FULL_CAUSAL,
) -> SampleLayout:
    """The sample layout ``layout`` (``balanced`` or ``contiguous``, module doc).

    Args:
        sample_tokens: int64 [S]; batch_offsets: int64 [B + 1]; num_gpus: ``G``;
        samples_per_microbatch / tokens_per_microbatch: micro-batch sizing (at most one);
        span: the model's attention span (``ModelSpec.attention_span``).
    Returns:
        :class:`SampleLayout` with sample_gpu int32 [S], sample_mb int32 [S], mb_batch int32 [M].
    """
    if layout not in _LAYOUT_FUNCTIONS:
        raise ValueError(f"workload.layout={layout!r}: expected one of {list(LAYOUTS)}")
    return _LAYOUT_FUNCTIONS[layout](
        sample_tokens, batch_offsets, num_gpus, samples_per_microbatch, tokens_per_microbatch, span
    )


_LAYOUT_FUNCTIONS = {"balanced": balanced_layout, "contiguous": contiguous_layout}
assert tuple(_LAYOUT_FUNCTIONS) == LAYOUTS


def unbalanceable_batches(batch_offsets: np.ndarray, num_gpus: int) -> int:
    """Batches with fewer samples than GPUs (some GPU idles in every micro-batch); batch_offsets [B + 1]."""
    return int(np.count_nonzero(np.diff(np.asarray(batch_offsets, dtype=np.int64)) < num_gpus))


def microbatch_balance(tokens: np.ndarray) -> np.ndarray:
    """Per-micro-batch ``max_g / mean_g`` of per-GPU tokens; tokens [M, G] -> float64 [M] (1 if empty)."""
    t = np.asarray(tokens, dtype=np.float64)
    mean = t.mean(axis=-1)
    return np.divide(t.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0)
