"""Workload assembly: samples -> GPUs -> micro-batches -> loads ``x[m, l, j, e]``.

Glossary (docs/glossary.md): ``S`` samples, ``B`` batches, ``G`` GPUs of the EP group, ``M`` micro-batches
(global index over all batches), ``Mb`` micro-batches of one batch, ``L`` MoE layers, ``E`` experts.

The sample layout (where every sample runs) is :mod:`relibra.layout`; this module reduces a layout's
per-sample counts to loads.

:func:`microbatch_loads` and :func:`gpu_token_stats` reduce per-sample counts to per-(micro-batch,
GPU) loads with one sorted segment sum over flattened keys (no Python loop over tokens or samples).
:func:`layout_samples` runs the layout; :func:`assemble` reduces into a :class:`~relibra.types.Workload`;
:func:`build_workload` does everything from a :class:`~relibra.types.SampleCounts`.
:func:`sample_context` is the one builder of a planner's :class:`~relibra.planners.protocols.BatchContext`
(the simulator's, through :func:`batch_context`, and the control plane's tasks').

**Tensor and context parallelism** (``parallel.tp``, ``parallel.cp``, :mod:`relibra.parallel`): Megatron's
micro-batch is ``MBS`` samples per TP x CP group of ``n = tp * cp`` consecutive GPUs, and each of them
routes the ``1 / n`` of the group's tokens it holds. :func:`split_samples` turns every sample into its
``n`` **ranks** (rank ``r = cp_rank * tp + tp_rank``, Megatron's rank order): CP rank ``i`` holds chunks
``i`` and ``2 cp - 1 - i`` of the ``2 cp`` chunks of the sequence, and sequence parallelism gives each of
its ``tp`` GPUs ``1 / tp`` of them (:func:`rank_tokens`). :func:`build_workload` with ``group = n`` lays
the samples out over the ``G / n`` groups (``workload.samples_per_microbatch`` samples per group per
micro-batch; ``workload.tokens_per_microbatch`` stays a per-GPU budget, ``n`` times it per group) and puts
rank ``r`` of a sample on GPU ``group * n + r``. The counts of a rank are the sample's counts taken as
uniform along its sequence: expert ``e``'s share ``c_e * len_r / t`` rounded down, and the rounding's
leftovers given so that every rank keeps ``len_r * top_k`` routed slots per layer and every expert its
``c_e`` (:func:`split_counts`; the experts' order for the leftovers rotates with the sample and the layer,
so no rank gets them all). Choice left open: the per-sample counts keep no position, so a chunk's own
routing (which per-token routes would give) is replaced by its even share; the pad to a multiple of
``2 cp tp`` tokens that packed-sequence trainers add is not modelled (under ``2 cp tp`` tokens a sample).
With ``tp = cp = 1`` nothing is split and every array is what it was.

**A TP x CP group larger than the EP group** (``G`` dividing ``n``; :func:`relibra.parallel.ep_group_ranks`):
the EP group holds the first ``G`` ranks of every sample of the micro-batch (CP ranks ``0 .. G / tp - 1``)
and the other EP groups the rest. :func:`parallel_workload` keeps those ranks only (``held = G``): every
micro-batch is ``MBS`` samples on the one group the EP group holds part of, rank ``r`` on GPU ``r``, each GPU
still routing ``1 / n`` of its samples' tokens, and the attention span is a rank's of ``n``
(:func:`relibra.parallel.rank_span`). Tokens are conserved over the EP groups together (the ``n / G`` of
them hold the ranks ``k G .. (k + 1) G - 1``), not on one.
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
from relibra.parallel import ParallelDims, ep_group_ranks, rank_span
from relibra.planners.protocols import BatchContext
from relibra.types import SampleCounts, Workload

__all__ = [
    "assemble",
    "build_workload",
    "gpu_token_stats",
    "microbatch_loads",
    "parallel_workload",
    "rank_tokens",
    "split_counts",
    "split_samples",
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


def rank_tokens(sample_tokens: np.ndarray, tp: int, cp: int) -> np.ndarray:
    """int64 [S, tp * cp]: the tokens each rank of a TP x CP group holds of each sample (module doc).

    CP rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` of the ``2 cp`` chunks (chunk ``c`` is tokens
    ``floor(t c / 2cp) .. floor(t (c + 1) / 2cp)``; Megatron-core ``get_batch_on_this_cp_rank``); its ``tp``
    GPUs hold ``floor`` / ``ceil`` of ``1 / tp`` of them each. Rank ``cp_rank * tp + tp_rank``.
    """
    t = np.asarray(sample_tokens, dtype=np.int64)[:, None]
    if cp > 1:
        bound = t * np.arange(2 * cp + 1) // (2 * cp)  # [S, 2cp + 1]
        chunk = np.diff(bound, axis=1)  # [S, 2cp]
        held = chunk[:, :cp] + chunk[:, ::-1][:, :cp]  # rank i: chunks i and 2cp - 1 - i
    else:
        held = t
    cut = held[:, :, None] * np.arange(tp + 1) // tp  # [S, cp, tp + 1]
    return np.diff(cut, axis=2).reshape(t.shape[0], cp * tp)


def split_counts(
    counts: np.ndarray, tokens: np.ndarray, parts: np.ndarray, top_k: int, held: int | None = None
) -> np.ndarray:
    """Each sample's counts split over its ranks (module doc): exact sums both ways.

    Args:
        counts: int [S, L, E]; tokens: int [S] (``counts[s].sum(-1) == tokens[s] * top_k``);
        parts: int [S, n] tokens of each rank (rows summing to ``tokens``); held: keep the first ``held``
            ranks of each sample only (None: all ``n``; the EP group's share of a larger TP x CP group).
    Returns:
        int32 [S * h, L, E] (``h = held or n``): rank ``r < h`` of sample ``s`` at row ``s * h + r``;
        ``out[s*h + r].sum(-1) == parts[s, r] * top_k``, and with ``h = n``
        ``out[s*n:(s+1)*n].sum(0) == counts[s]``. A rank's rows are the same whatever ``held``.
    """
    num_s, num_l, num_e = np.shape(counts)
    n = parts.shape[1]
    h = n if held is None else held
    if not 1 <= h <= n:
        raise ValueError(f"held={held}: expected 1 .. {n} ranks of a sample")
    out = np.empty((num_s * h, num_l, num_e), dtype=np.int32)
    # NOTE: blocks of samples bound the int64 temporaries to about SPLIT_BLOCK_VALUES values each.
    block = (
        max(1, SPLIT_BLOCK_VALUES // max(num_l * num_e * n, 1))
        if h < n
        else max(1, SPLIT_BLOCK_VALUES // max(num_l * num_e, 1))
    )
    for lo in range(0, num_s, block):
        hi = min(lo + block, num_s)
        rows = _split_block(counts[lo:hi], tokens[lo:hi], parts[lo:hi], top_k, lo)
        if h < n:
            rows = rows.reshape(hi - lo, n, num_l, num_e)[:, :h].reshape(-1, num_l, num_e)
        out[lo * h : hi * h] = rows
    return out


SPLIT_BLOCK_VALUES = 1 << 22
"""Values of ``[samples, L, E]`` :func:`split_counts` handles at a time (a memory bound, not a result)."""


def _split_block(
    counts: np.ndarray, tokens: np.ndarray, parts: np.ndarray, top_k: int, first: int
) -> np.ndarray:
    """:func:`split_counts` of samples ``first ..`` (the rotation counts them from 0 of the whole array)."""
    c = np.asarray(counts, dtype=np.int64)
    num_s, num_l, num_e = c.shape
    n = parts.shape[1]
    parts = np.asarray(parts, dtype=np.int64)
    t = np.maximum(np.asarray(tokens, dtype=np.int64), 1)[:, None, None]
    # NOTE: the leftovers go in an expert order rotated by (sample, layer), so no rank collects them all.
    shift = ((first + np.arange(num_s))[:, None] * num_l + np.arange(num_l)[None, :]) % num_e  # [S, L]
    order = (np.arange(num_e)[None, None, :] + shift[:, :, None]) % num_e  # [S, L, E]
    c = np.take_along_axis(c, order, axis=2)
    floors = [c * parts[:, r, None, None] // t for r in range(n)]  # n x [S, L, E]
    col_left = np.cumsum(c - sum(floors), axis=2)  # [S, L, E]: leftover of each expert, cumulated
    col_prev = col_left - (c - sum(floors))
    out = np.empty((num_s, n, num_l, num_e), dtype=np.int64)
    row_end = np.zeros((num_s, num_l), dtype=np.int64)
    for r in range(n):
        row_start = row_end
        row_end = row_start + parts[:, r, None] * top_k - floors[r].sum(axis=2)  # [S, L]
        # the leftover units of expert e that fall in rank r's share (north-west corner rule)
        take = np.minimum(row_end[..., None], col_left) - np.maximum(row_start[..., None], col_prev)
        out[:, r] = floors[r] + np.clip(take, 0, None)
    back = np.argsort(order, axis=2)
    out = np.take_along_axis(out, back[:, None], axis=3)
    return out.reshape(num_s * n, num_l, num_e)


def split_samples(counts: SampleCounts, tp: int = 1, cp: int = 1, held: int | None = None) -> SampleCounts:
    """Every sample as its ``tp * cp`` ranks (module doc): counts int32 [S * h, L, E], tokens int64
    [S * h], batch offsets times ``h``, for the first ``h = held`` ranks (None: all ``n = tp * cp``; fewer
    where the EP group holds part of a TP x CP group, :func:`relibra.parallel.ep_group_ranks`); ``counts``
    itself when ``tp = cp = 1``."""
    n = tp * cp
    if n == 1:
        return counts
    h = n if held is None else held
    parts = rank_tokens(counts.tokens, tp, cp)
    domain = None if counts.sample_domain is None else np.repeat(counts.sample_domain, h)
    meta = {**counts.meta, "ranks_per_sample": h}
    if h < n:
        meta["ranks_per_group"] = n
    return SampleCounts(
        counts=split_counts(counts.counts, counts.tokens, parts, counts.top_k, held),
        tokens=parts[:, :h].reshape(-1),
        batch_offsets=np.asarray(counts.batch_offsets, dtype=np.int64) * h,
        top_k=counts.top_k,
        sample_domain=domain,
        domain_names=counts.domain_names,
        meta=meta,
    )


def _group_layout(
    rank_tokens_: np.ndarray,
    batch_offsets: np.ndarray,
    num_gpus: int,
    group: int,
    samples_per_microbatch: int | None,
    tokens_per_microbatch: int | None,
    layout: str,
    span: AttentionSpan,
) -> SampleLayout:
    """The layout of split samples (rank rows, :func:`split_samples`): the whole samples over the
    ``G / group`` TP x CP groups, then rank ``r`` of a sample on GPU ``group_index * group + r``."""
    if num_gpus % group:
        raise ValueError(f"a TP x CP group of {group} GPUs does not divide the EP group of {num_gpus}")
    tokens = np.asarray(rank_tokens_, dtype=np.int64).reshape(-1, group).sum(axis=1)
    offsets = np.asarray(batch_offsets, dtype=np.int64)
    if np.any(offsets % group):
        raise ValueError(f"batch_offsets {offsets.tolist()} are not whole samples of {group} ranks")
    budget = None if tokens_per_microbatch is None else tokens_per_microbatch * group
    placed = layout_samples(
        tokens, offsets // group, num_gpus // group, samples_per_microbatch, budget, layout, span
    )
    gpu = (placed.sample_gpu.astype(np.int64)[:, None] * group + np.arange(group)).reshape(-1)
    return SampleLayout(
        sample_gpu=gpu.astype(np.int32),
        sample_mb=np.repeat(placed.sample_mb, group).astype(np.int32),
        mb_batch=placed.mb_batch,
    )


def build_workload(
    counts: SampleCounts,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    layout: str = LAYOUTS[0],
    span: AttentionSpan = FULL_CAUSAL,
    group: int = 1,
) -> Workload:
    """:func:`layout_samples` then :func:`assemble`: per-sample counts to a :class:`Workload`; ``span`` is
    the model's attention span (``ModelSpec.attention_span``). With ``group = tp * cp > 1`` the counts are
    :func:`split_samples`' ranks, laid out by whole samples over the TP x CP groups (module doc)."""
    if group > 1:
        placed = _group_layout(
            counts.tokens,
            counts.batch_offsets,
            num_gpus,
            group,
            samples_per_microbatch,
            tokens_per_microbatch,
            layout,
            span,
        )
        return assemble(counts, placed, num_gpus, span.split(group))
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


def parallel_workload(
    counts: SampleCounts,
    parallel: ParallelDims,
    num_gpus: int,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    layout: str = LAYOUTS[0],
    span: AttentionSpan = FULL_CAUSAL,
) -> tuple[SampleCounts, Workload]:
    """Whole samples ``counts`` [S, L, E] under the parallel dimensions: the ranks the EP group of
    ``num_gpus`` holds (:func:`split_samples` with :func:`relibra.parallel.ep_group_ranks`) and their workload
    (module doc). Returns (rank counts [S * h, L, E], workload with load [M, L, G, E]); ``counts`` and
    :func:`build_workload` unchanged when ``tp = cp = 1``."""
    held = ep_group_ranks(parallel, num_gpus)
    ranks = split_samples(counts, parallel.tp, parallel.cp, held)
    if held == parallel.group:
        return ranks, build_workload(
            ranks, num_gpus, samples_per_microbatch, tokens_per_microbatch, layout, span, parallel.group
        )
    placed = _group_layout(
        ranks.tokens, ranks.batch_offsets, num_gpus, held, samples_per_microbatch,
        tokens_per_microbatch, layout, span,
    )  # fmt: skip
    return ranks, assemble(ranks, placed, num_gpus, rank_span(span, parallel))


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
