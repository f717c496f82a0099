"""Stage 1 of the control plane: the samples a trainer submits, and one sealed batch's sample layout and
per-micro-batch loads.

Pure functions of the batch's samples (in id order) and the settings; the coordinator calls them outside
its lock (:mod:`relibra.control.plane`).

**Tensor and context parallelism** (the plane's cost model's :class:`~relibra.parallel.ParallelDims`,
``cost.parallel``): the batch's workload is :func:`relibra.workload.parallel_workload`'s, the simulator's.
With ``tp * cp > 1`` every sample becomes the ``h`` ranks of its TP x CP group the EP group holds (``h = tp
* cp``, or ``G`` when a group is wider than the EP group: :func:`relibra.parallel.ep_group_ranks`), whole
samples go to TP x CP groups, and rank ``r`` of a sample runs on GPU ``group * h + r``; the planners see
ranks (:attr:`~relibra.control.jobs.Assembled.counts`, row ``s * h + r``), and the delivered plan's
``sample_gpu`` has ``h`` rows per sample in id order. A rank's counts are the even share of its sample's
(:func:`relibra.workload.split_counts`: the submitted counts keep no token positions), so the submitted
counts must hold ``tokens * top_k`` routed slots per sample and layer. With ``tp = cp = 1`` nothing is split
and every array is what it was.
"""

from __future__ import annotations

import time

import numpy as np

from relibra.cluster import ModelSpec
from relibra.control.config import ControlPlaneConfig
from relibra.control.jobs import Assembled
from relibra.layout import SampleLayout
from relibra.parallel import ParallelDims, ep_group_ranks
from relibra.trace.format import RoutingTrace
from relibra.types import SampleCounts
from relibra.workload import microbatch_loads, parallel_workload, split_samples

__all__ = ["assemble_batch", "given_layout", "submitted_samples"]


def assemble_batch(
    counts: np.ndarray,
    sample_tokens: np.ndarray,
    num_gpus: int,
    config: ControlPlaneConfig,
    model: ModelSpec,
    parallel: ParallelDims | None = None,
) -> Assembled:
    """The batch laid out by ``config.layout`` (attention work as ``model.attention_span`` counts it) and
    its loads, under ``parallel`` (None: EP only; module doc).

    ``counts`` int32 [Sb, L, E] and ``sample_tokens`` int64 [Sb], samples in id order. Under ``tp * cp >
    1`` the result carries the ranks' counts [Sb * h, L, E] and tokens [Sb * h] the planners see.
    """
    t0 = time.perf_counter()
    parallel = parallel if parallel is not None else ParallelDims()
    whole = _whole_samples(counts, sample_tokens, model.top_k, parallel)
    ranks, workload = parallel_workload(
        whole,
        parallel,
        num_gpus,
        config.samples_per_microbatch,
        config.tokens_per_microbatch,
        config.layout,
        model.attention_span,
    )
    placed = SampleLayout(workload.sample_gpu, workload.sample_mb, workload.mb_batch)
    split = parallel.group > 1
    return Assembled(
        placed,
        placed.local_mb(),
        workload.load,
        time.perf_counter() - t0,
        counts=ranks.counts if split else None,
        sample_tokens=ranks.tokens if split else None,
    )


def given_layout(
    layout: SampleLayout,
    counts: np.ndarray,
    num_gpus: int,
    parallel: ParallelDims | None = None,
    sample_tokens: np.ndarray | None = None,
    top_k: int | None = None,
) -> Assembled:
    """A caller's layout of one batch (samples in id order) and its loads, checked against ``counts``
    (int32 [Sb, L, E]); a layout of another shape, batch or range raises :class:`ValueError`.

    Under ``parallel`` with ``tp * cp > 1`` (module doc; ``sample_tokens`` int64 [Sb] and the model's
    ``top_k`` are then needed to split the samples) ``layout.sample_gpu`` names each sample's TP x CP group,
    in ``[0, G / h)`` (its data-parallel rank within the EP group, the GPU when ``tp = cp = 1``): rank ``r``
    of the sample runs on GPU ``group * h + r`` in the sample's micro-batch."""
    t0 = time.perf_counter()
    split = parallel is not None and parallel.group > 1
    held = ep_group_ranks(parallel, num_gpus) if parallel is not None and split else 1
    num_s, g = counts.shape[0], num_gpus // held
    gpu, mb = np.asarray(layout.sample_gpu), np.asarray(layout.sample_mb)
    if gpu.shape != (num_s,) or mb.shape != (num_s,):
        raise ValueError(f"layout must place the batch's {num_s} samples, got {gpu.shape} / {mb.shape}")
    num_mb = layout.num_microbatches
    if np.any(layout.mb_batch != 0) or gpu.min() < 0 or gpu.max() >= g or mb.min() < 0 or mb.max() >= num_mb:
        where = f"GPUs [0, {g})" if not split else f"TP x CP groups [0, {g}) (of {held} GPUs each)"
        raise ValueError(
            f"layout must be one batch (mb_batch all 0) on {where} and its {num_mb} micro-batches"
        )
    if not split:
        load = microbatch_loads(counts, gpu, mb, num_mb, num_gpus)
        return Assembled(layout, mb.astype(np.int32), load, time.perf_counter() - t0)
    assert parallel is not None
    if sample_tokens is None or top_k is None:
        raise ValueError(
            f"given_layout under parallel.tp * parallel.cp = {parallel.group} > 1 needs sample_tokens and "
            "top_k to split the samples into their ranks"
        )
    whole = _whole_samples(counts, sample_tokens, top_k, parallel)
    ranks = split_samples(whole, parallel.tp, parallel.cp, held)
    rank_gpu = (gpu.astype(np.int64)[:, None] * held + np.arange(held)).reshape(-1).astype(np.int32)
    rank_mb = np.repeat(mb, held).astype(np.int32)
    placed = SampleLayout(rank_gpu, rank_mb, np.asarray(layout.mb_batch, dtype=np.int32))
    load = microbatch_loads(ranks.counts, rank_gpu, rank_mb, num_mb, num_gpus)
    return Assembled(
        placed, rank_mb, load, time.perf_counter() - t0, counts=ranks.counts, sample_tokens=ranks.tokens
    )


def _whole_samples(
    counts: np.ndarray, sample_tokens: np.ndarray, top_k: int, parallel: ParallelDims
) -> SampleCounts:
    """One batch of whole samples; under ``tp * cp > 1`` checked to hold ``tokens * top_k`` routed slots per
    sample and layer, which the split into ranks keeps (:func:`relibra.workload.split_counts`)."""
    tokens = np.asarray(sample_tokens, dtype=np.int64)
    if parallel.group > 1:
        slots = np.asarray(counts, dtype=np.int64).sum(axis=-1)  # [Sb, L]
        bad = np.argwhere(slots != tokens[:, None] * top_k)
        if bad.size:
            s, l = (int(v) for v in bad[0])
            raise ValueError(
                f"sample {s} (id order) routes {slots[s, l]} slots at layer {l} but holds {tokens[s]} "
                f"tokens x top_k={top_k}: under parallel.tp * parallel.cp = {parallel.group} > 1 the counts "
                "are split over the sample's ranks, which needs tokens * top_k slots in every layer"
            )
    return SampleCounts(
        counts=counts,
        tokens=tokens,
        batch_offsets=np.array([0, counts.shape[0]], dtype=np.int64),
        top_k=top_k,
    )


def submitted_samples(
    samples: SampleCounts | RoutingTrace | np.ndarray,
    tokens: np.ndarray | None,
    num_layers: int,
    num_experts: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Counts [s, L, E] and int64 tokens [s] of what :meth:`~relibra.control.plane.ControlPlane.submit`
    got; a shape other than the model's ``(L, E)``, or a counts array without tokens, raises
    :class:`ValueError`."""
    if isinstance(samples, RoutingTrace):
        samples = samples.to_counts()
    if isinstance(samples, SampleCounts):
        counts, toks = samples.counts, samples.tokens
    else:
        if tokens is None:
            raise ValueError("a counts array [s, L, E] needs tokens [s] (tokens per sample)")
        counts, toks = np.asarray(samples), np.asarray(tokens, dtype=np.int64)
    expect = (num_layers, num_experts)
    if counts.ndim != 3 or counts.shape[1:] != expect:
        raise ValueError(f"counts must be [s, L, E] with (L, E)={expect}, got shape {counts.shape}")
    if toks.shape != (counts.shape[0],):
        raise ValueError(f"tokens must be [s]=({counts.shape[0]},), got shape {toks.shape}")
    return counts, toks
