"""Stage 1 of the control plane: the samples a trainer submits, and one sealed batch's sample layout and
per-micro-batch loads.

Pure functions of the batch's samples (in id order) and the settings; the coordinator calls them outside
its lock (:mod:`relibra.control.plane`).
"""

from __future__ import annotations

import time

import numpy as np

from relibra.cluster import ModelSpec
from relibra.control.config import ControlPlaneConfig
from relibra.control.jobs import Assembled
from relibra.layout import SampleLayout, layout_samples
from relibra.trace.format import RoutingTrace
from relibra.types import SampleCounts
from relibra.workload import microbatch_loads

__all__ = ["assemble_batch", "given_layout", "submitted_samples"]


def assemble_batch(
    counts: np.ndarray, sample_tokens: np.ndarray, num_gpus: int, config: ControlPlaneConfig, model: ModelSpec
) -> Assembled:
    """The batch laid out by ``config.layout`` (attention work as ``model.attention_span`` counts it) and
    its loads.

    ``counts`` int32 [Sb, L, E] and ``sample_tokens`` int64 [Sb], samples in id order.
    """
    t0 = time.perf_counter()
    layout = layout_samples(
        sample_tokens,
        np.array([0, counts.shape[0]], dtype=np.int64),
        num_gpus,
        config.samples_per_microbatch,
        config.tokens_per_microbatch,
        config.layout,
        model.attention_span,
    )
    local_mb = layout.local_mb()
    load = microbatch_loads(counts, layout.sample_gpu, local_mb, layout.num_microbatches, num_gpus)
    return Assembled(layout, local_mb, load, time.perf_counter() - t0)


def given_layout(layout: SampleLayout, counts: np.ndarray, num_gpus: int) -> Assembled:
    """A caller's layout of one batch (samples in id order) and its loads, checked against ``counts``
    (int32 [Sb, L, E]); a layout of another shape, batch or range raises :class:`ValueError`."""
    t0 = time.perf_counter()
    num_s, g = counts.shape[0], num_gpus
    gpu, mb = np.asarray(layout.sample_gpu), np.asarray(layout.sample_mb)
    if gpu.shape != (num_s,) or mb.shape != (num_s,):
        raise ValueError(f"layout must place the batch's {num_s} samples, got {gpu.shape} / {mb.shape}")
    num_mb = layout.num_microbatches
    if np.any(layout.mb_batch != 0) or gpu.min() < 0 or gpu.max() >= g or mb.min() < 0 or mb.max() >= num_mb:
        raise ValueError(
            f"layout must be one batch (mb_batch all 0) on GPUs [0, {g}) and its {num_mb} micro-batches"
        )
    load = microbatch_loads(counts, gpu, mb, num_mb, g)
    return Assembled(layout, mb.astype(np.int32), load, time.perf_counter() - t0)


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
