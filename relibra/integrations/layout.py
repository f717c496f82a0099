"""The sample layout of trainers whose micro-batches hold a fixed number of samples per GPU.

verl without dynamic batch size (``actor_rollout_ref.actor.use_dynamic_bsz=false``) hands data-parallel
rank ``g`` the ``g``-th contiguous chunk of the batch and cuts it into micro-batches of exactly
``ppo_micro_batch_size_per_gpu`` samples (``prepare_micro_batches``, ``verl/workers/engine/utils.py``). The
suite's ``balanced`` layout (:func:`relibra.layout.balanced_layout`) packs bins by tokens, not by sample
count, so verl could not reproduce it. :func:`fixed_count_layout` is its equal-count counterpart (the
kind of partition verl's own ``get_seqlen_balanced_partitions(equal_size=True)`` makes for its DP ranks):

1. samples sorted by tokens, longest first (ties by id), are dealt to the ``Mb`` micro-batches in snake
   order (0, 1, ..., Mb-1, Mb-1, ..., 0, ...), so every micro-batch gets ``G * K`` samples of similar
   total length;
2. within a micro-batch, longest first, each sample goes to the GPU with the fewest tokens among those
   holding fewer than ``K`` samples (LPT under a count bound; ties to the lower GPU).

Choices left open: snake dealing rather than an exact equal-size partition (Karmarkar-Karp); tokens as the
only key (the ``balanced`` layout's second key, causal attention pairs, is not used).
"""

from __future__ import annotations

import numpy as np

from relibra.layout import SampleLayout

__all__ = ["fixed_count_layout"]


def fixed_count_layout(sample_tokens: np.ndarray, num_gpus: int, samples_per_microbatch: int) -> SampleLayout:
    """Every (GPU, micro-batch) gets exactly ``K = samples_per_microbatch`` samples (module doc).

    Args:
        sample_tokens: int [S] tokens of each sample of one batch; ``S`` a multiple of ``G * K``.
    Returns:
        :class:`SampleLayout` of one batch: ``sample_gpu`` [S], ``sample_mb`` [S] (``Mb = S / (G * K)``).
    """
    tokens = np.asarray(sample_tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.size == 0:
        raise ValueError(f"sample_tokens must be a non-empty [S] array, got shape {tokens.shape}")
    if num_gpus < 1 or samples_per_microbatch < 1:
        raise ValueError(
            f"num_gpus={num_gpus} and samples_per_microbatch={samples_per_microbatch} must be >= 1"
        )
    per_mb = num_gpus * samples_per_microbatch
    if tokens.size % per_mb:
        raise ValueError(
            f"{tokens.size} samples do not fill micro-batches of {samples_per_microbatch} samples on each of "
            f"{num_gpus} GPUs: the batch needs a multiple of {per_mb} samples"
        )
    num_mb = tokens.size // per_mb
    order = np.lexsort((np.arange(tokens.size), -tokens))  # longest first, ties by id
    snake = np.r_[np.arange(num_mb), np.arange(num_mb)[::-1]]
    sample_mb = np.empty(tokens.size, dtype=np.int32)
    sample_mb[order] = snake[np.arange(tokens.size) % (2 * num_mb)] if num_mb > 1 else 0
    sample_gpu = np.empty(tokens.size, dtype=np.int32)
    for m in range(num_mb):
        load = np.zeros(num_gpus, dtype=np.int64)
        held = np.zeros(num_gpus, dtype=np.int64)
        for s in order[sample_mb[order] == m]:
            open_gpus = np.flatnonzero(held < samples_per_microbatch)
            g = int(open_gpus[np.argmin(load[open_gpus])])
            sample_gpu[s] = g
            load[g] += tokens[s]
            held[g] += 1
    return SampleLayout(sample_gpu=sample_gpu, sample_mb=sample_mb, mb_batch=np.zeros(num_mb, dtype=np.int32))
