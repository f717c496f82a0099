"""Workload assembly: samples -> GPUs -> micro-batches -> loads ``x[m, l, j, e]``.

Glossary (DESIGN.md): ``S`` samples, ``B`` batches, ``G`` GPUs of the EP group, ``M`` micro-batches
(global index over all batches), ``Mb`` micro-batches of one batch, ``L`` MoE layers, ``E`` experts.

The sample layout (where every sample runs) is :mod:`relibra.layout`; this module reduces a layout's
per-sample counts to loads.

:func:`microbatch_loads` and :func:`gpu_token_stats` reduce per-sample counts to per-(micro-batch,
GPU) loads with one sorted segment sum over flattened keys (no Python loop over tokens or samples).
:func:`layout_samples` runs the layout; :func:`assemble` reduces into a :class:`~relibra.types.Workload`;
:func:`build_workload` does everything from a :class:`~relibra.types.SampleCounts`.
:func:`sample_context` is the one builder of a planner's :class:`~relibra.planners.protocols.BatchContext`
(the simulator's, through :func:`batch_context`, and the control plane's tasks').
"""

from __future__ import annotations

import numpy as np

from relibra.attention_span import FULL_CAUSAL, AttentionSpan
from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.layout import (
    LAYOUTS,
    SampleLayout,
    layout_samples,
)
from relibra.planners.protocols import BatchContext
from relibra.types import SampleCounts, Workload

__all__ = [
    "assemble",
    "build_workload",
    "gpu_token_stats",
    "microbatch_loads",
]


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
    span: AttentionSpan = FULL_CAUSAL,
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and attention pairs each GPU holds in each micro-batch.

    Args:
        sample_tokens: int [S']; sample_gpu: int [S']; sample_mb: int [S'] in ``[0, num_microbatches)``;
        span: the model's attention span (``ModelSpec.attention_span``).
    Returns:
        tokens int64 [Mb, G]; causal_pairs float64 [Mb, G] (sum over samples of ``span.pairs``: ``len *
        (len + 1) / 2`` under full causal attention).
    """
    lens = np.asarray(sample_tokens, dtype=np.int64)
    keys = _group_keys(sample_gpu, sample_mb, num_microbatches, num_gpus)
    if keys.shape != lens.shape:
        raise ValueError(f"sample_tokens has shape {lens.shape} but sample_gpu has {keys.shape}")
    size = num_microbatches * num_gpus
    tokens = np.zeros(size, dtype=np.int64)
    np.add.at(tokens, keys, lens)
    pairs = np.bincount(keys, weights=span.pairs(lens), minlength=size)
    return tokens.reshape(num_microbatches, num_gpus), pairs.reshape(num_microbatches, num_gpus)


def assemble(
    counts: SampleCounts, layout: SampleLayout, num_gpus: int, span: AttentionSpan = FULL_CAUSAL
) -> Workload:
    """Loads of every micro-batch of every batch under ``layout``.

    Args:
        counts: per-sample counts (``counts.counts`` int32 [S, L, E]).
        layout: where each sample runs (from :func:`layout_samples` or a planner's reassignment).
        num_gpus: ``G``; span: the model's attention span (``ModelSpec.attention_span``).
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
    tokens, pairs = gpu_token_stats(
        counts.tokens, layout.sample_gpu, layout.sample_mb, num_mb, num_gpus, span
    )
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
    layout: str = LAYOUTS[0],
    span: AttentionSpan = FULL_CAUSAL,
) -> Workload:
    """:func:`layout_samples` then :func:`assemble`: per-sample counts to a :class:`Workload`; ``span`` is
    the model's attention span (``ModelSpec.attention_span``)."""
    placed = layout_samples(
        counts.tokens,
        counts.batch_offsets,
        num_gpus,
        samples_per_microbatch,
        tokens_per_microbatch,
        layout,
        span,
    )
    return assemble(counts, placed, num_gpus, span)


def sample_context(
    *,
    batch: int,
    counts: np.ndarray,
    sample_tokens: np.ndarray,
    sample_gpu: np.ndarray,
    sample_mb: np.ndarray,
    load: np.ndarray,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    prev_home: np.ndarray | None = None,
    history: tuple[np.ndarray, ...] = (),
    seed: int = 0,
    prev_redundant: np.ndarray | None = None,
) -> BatchContext:
    """A :class:`BatchContext` over one batch's samples, with the ``regroup`` closure that recomputes the
    loads for a new sample assignment.

    Args:
        counts: int32 [Sb, L, E]; sample_tokens: int64 [Sb]; sample_gpu, sample_mb: int32 [Sb] (local
            micro-batch); load: int32 [Mb, L, G, E] under them; prev_home: int32 [L, E] or None.
    """
    num_mb, g = int(np.shape(load)[0]), cluster.num_gpus
    memo: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}

    def regroup(new_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # NOTE: remembers its last answer, so that a locality round and the stage after it share one regroup.
        key = np.asarray(new_gpu, dtype=np.int32).tobytes()
        if key not in memo:
            memo.clear()
            tok, _ = gpu_token_stats(sample_tokens, new_gpu, sample_mb, num_mb, g)
            memo[key] = (microbatch_loads(counts, new_gpu, sample_mb, num_mb, g), tok)
        return memo[key]

    return BatchContext(
        batch=batch,
        counts=counts,
        sample_tokens=sample_tokens,
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        load=load,
        cluster=cluster,
        model=model,
        cost=cost,
        prev_home=prev_home,
        history=history,
        seed=seed,
        regroup=regroup,
        prev_redundant=prev_redundant,
    )


def batch_context(
    counts: SampleCounts,
    workload: Workload,
    batch: int,
    cluster: ClusterSpec,
    model: ModelSpec,
    cost: CostModel,
    *,
    prev_home: np.ndarray | None = None,
    history: tuple[np.ndarray, ...] = (),
    seed: int = 0,
    prev_redundant: np.ndarray | None = None,
) -> BatchContext:
    """The :class:`BatchContext` of batch ``batch`` of a workload (the simulator's; seed ``seed + batch``)."""
    sl = counts.batch(batch)
    mbs = workload.batch_microbatches(batch)
    if mbs.size == 0:
        raise ValueError(f"batch {batch} has no micro-batches in the workload")
    first = int(mbs[0])
    return sample_context(
        batch=batch,
        counts=counts.counts[sl],
        sample_tokens=counts.tokens[sl],
        sample_gpu=workload.sample_gpu[sl],
        sample_mb=(workload.sample_mb[sl] - first).astype(np.int32),
        load=workload.load[first : first + int(mbs.size)],
        cluster=cluster,
        model=model,
        cost=cost,
        prev_home=prev_home,
        history=history,
        seed=seed + batch,
        prev_redundant=prev_redundant,
    )
