"""Pipeline parallelism around the EP group (``parallel.pp``, ``parallel.vpp``; :mod:`relibra.parallel`).

Every stage is its own EP group of ``G`` GPUs holding its layers (:func:`relibra.parallel.stage_layers`);
one micro-batch visits every stage, so every stage sees the same tokens per GPU and the planner's plan for
a layer is the plan of the stage that holds it. A pass over the batch is Megatron's interleaved 1F1B
schedule (``megatron/core/pipeline_parallel/schedules.py``; Narayanan et al. 2021, arXiv 2104.04473,
Section 2.2.2), run op by op over each (stage, model chunk, micro-batch)'s own seconds
(:func:`relibra.cost.schedule.simulate_schedule`): a slow micro-batch on one stage delays the stages it
feeds, which a price from the stages' means misses. With equal micro-batches the schedule's fill and drain
idle the slowest stage for a bubble of ``(pp - 1) / (vpp * M)`` of its busy seconds (:func:`bubble_fraction`,
tested equal). After the flush every stage runs its own optimizer step and gradient collectives at once;
the step is the latest stage's finish plus its per-step seconds (:func:`pipelined`). Before results
generation 6 the step was priced from means: the slowest stage's busy seconds times ``1 + bubble``.

Between stages each micro-batch's activations travel forward and their gradients back, once per model
chunk (``vpp`` sends each way per stage and micro-batch): ``tokens x hidden`` bf16 per GPU to the same GPU
of the next stage, over the rail NIC (stages are whole nodes), or NVLink when the whole pipeline lies in
one NVLink domain (:func:`p2p_send_time`). They are charged exposed (NOTE: Megatron's ``overlap_p2p_comm``
hides part of them under the interleaved schedule; not modelled).

Terms summed over layers but kept per batch (exposed refill, migration, redundant-copy sync, an online
planner's critical path, host overhead) are apportioned to a stage by its share of the MoE layers: each
stage moves and refreshes its own layers' experts over its own EP group, in parallel with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.overlap import overlapped_time
from relibra.cost.schedule import simulate_schedule
from relibra.parallel import ParallelDims

__all__ = ["StagePass", "StageTimes", "bubble_fraction", "p2p_send_time", "pipelined"]

BF16_BYTES = 2
FORWARD_SHARE = 1.0 / 3.0
"""The forward's share of a (micro-batch, chunk)'s update seconds in the schedule (a GEMM's forward third,
:data:`relibra.cost.step.FORWARD_FLOPS_SHARE`; the all-to-all's and memory-bound kernels' half is not split
apart: the schedule's makespan moves by a few percent of one micro-batch's chunk at most)."""


class _Cost(Protocol):
    """What :func:`p2p_send_time` reads of the cost model."""

    cluster: ClusterSpec
    model: ModelSpec
    parallel: ParallelDims


def bubble_fraction(pp: int, vpp: int, microbatches: int) -> float:
    """Interleaved 1F1B's idle share of a stage's busy seconds: ``(pp - 1) / (vpp * M)``."""
    return (pp - 1) / (vpp * microbatches) if microbatches > 0 else 0.0


def p2p_send_time(cost: _Cost, tokens: np.ndarray) -> np.ndarray:
    """Seconds of one stage-to-stage send of a micro-batch's activations: tokens [Mb, G] -> [Mb].

    Each GPU sends its ``tokens x hidden`` bf16 values to its counterpart in the next stage, all GPUs at
    once on their own links: the busiest GPU's bytes over the rail NIC (``nic_bytes_per_s *
    nic_efficiency``), or over NVLink when ``cluster.nvl_domain`` holds the whole pipeline, plus
    ``alltoall_latency_s``.
    """
    c, hw = cost.cluster, cost.cluster.hardware
    one_domain = c.nvl_domain is not None and c.nvl_domain >= c.num_gpus * cost.parallel.pp
    rate = (
        hw.nvlink_bytes_per_s * hw.nvlink_efficiency if one_domain else hw.nic_bytes_per_s * hw.nic_efficiency
    )
    t = np.asarray(tokens, dtype=np.float64)
    return np.asarray(t.max(axis=-1) * cost.model.hidden * BF16_BYTES / rate + hw.alltoall_latency_s)


@dataclass(frozen=True)
class StagePass:
    """One pass's seconds per micro-batch before the stages are cut, every layer of the model."""

    comp: np.ndarray
    """float64 [Mb, L]: each MoE layer's compute (everything but the all-to-all)."""
    comm: np.ndarray
    """float64 [Mb, L]: each MoE layer's all-to-all."""
    dense: np.ndarray
    """float64 [Mb]: one dense layer."""
    head: np.ndarray
    """float64 [Mb]: embedding, LM head and loss (on the last stage)."""
    p2p: np.ndarray
    """float64 [Mb]: every pipeline send of one stage for the micro-batch (``vpp`` or ``2 * vpp`` sends)."""
    spread: float
    """Seconds over all MoE layers kept per batch, apportioned by each stage's share of them."""
    overlap: bool
    """``cluster.ep_overlap``: join compute and all-to-all as :func:`relibra.cost.overlap.overlapped_time`."""
    contention: float
    """The overlapped all-to-all's SM share (:attr:`relibra.cluster.ClusterSpec.comm_sm_share`)."""


@dataclass(frozen=True)
class StageTimes:
    """A pipelined pass: its seconds and the slowest stage's parts."""

    total: float
    comm_exposed: float
    """All-to-all seconds not hidden behind compute, summed over every stage's layers."""
    slowest: int
    """The stage that sets the pace."""
    bubble: float
    """The slowest stage's bubble seconds."""
    p2p: float
    """The slowest stage's pipeline-send seconds."""
    per_step: tuple[float, ...]
    """The slowest stage's per-step seconds (as ``per_step`` returned them)."""


def _join(comp: np.ndarray, comm: np.ndarray, overlap: bool, contention: float) -> tuple[float, float]:
    if comp.shape[-1] == 0:
        return 0.0, 0.0
    if overlap:
        return overlapped_time(comp, comm, contention)
    total_comm = float(comm.sum())
    return float(comp.sum()) + total_comm, total_comm


def pipelined(
    chunk_of_layer: np.ndarray,
    dense_layers: int,
    pp: int,
    vpp: int,
    sp: StagePass,
    per_step: Callable[[int, float, float, float], tuple[float, ...]] | None = None,
) -> StageTimes:
    """Seconds of one pass through the pipeline (module doc).

    ``chunk_of_layer`` int [num_layers]: each layer's model chunk (virtual stage ``v``, on stage ``v mod
    pp``; model order, the ``dense_layers`` dense layers first); ``per_step`` (stage, first micro-batch's
    seconds, last micro-batch's seconds, the stage's share of the MoE layers) -> the stage's per-step
    seconds after the flush (None: a forward-only pass, none).
    """
    mb, num_moe = sp.comp.shape
    chunks = np.asarray(chunk_of_layer)
    moe_chunk, dense_chunk = chunks[dense_layers:], chunks[:dense_layers]
    moe_stage = moe_chunk % pp
    forward_only = per_step is None
    work = np.zeros((pp, vpp, mb))  # [pp, vpp, Mb]: each (stage, chunk, micro-batch)'s seconds
    busy_of = np.zeros(pp)
    after_of: list[tuple[float, ...]] = [()] * pp
    exposed_all = 0.0
    for s in range(pp):
        cols = np.flatnonzero(moe_stage == s)
        nd = int((dense_chunk % pp == s).sum())
        last = s == pp - 1
        moe, exposed = _join(sp.comp[:, cols], sp.comm[:, cols], sp.overlap, sp.contention)
        exposed_all += exposed
        share = len(cols) / num_moe if num_moe else 0.0
        raw = sp.comp[:, cols].sum(axis=1) + sp.comm[:, cols].sum(axis=1)  # [Mb]
        # NOTE: under overlap each micro-batch keeps its share of the stage's overlapped MoE seconds.
        scale = moe / float(raw.sum()) if raw.sum() > 0 else 0.0
        for c in range(vpp):
            v = c * pp + s
            on = moe_chunk[cols] == v
            work[s, c] = (
                scale * (sp.comp[:, cols[on]].sum(axis=1) + sp.comm[:, cols[on]].sum(axis=1))
                + int((dense_chunk == v).sum()) * sp.dense
                + sp.p2p / vpp
                + share * sp.spread / (mb * vpp)
            )
        if last:
            work[s, vpp - 1] += sp.head
        busy_of[s] = float(work[s].sum())
        per_mb = sp.comp[:, cols].sum(axis=1) + sp.comm[:, cols].sum(axis=1) + nd * sp.dense + sp.p2p
        if last:
            per_mb = per_mb + sp.head
        after_of[s] = per_step(s, float(per_mb[0]), float(per_mb[-1]), share) if per_step is not None else ()
    if pp == 1:  # NOTE: one stage runs its ops back to back: no schedule, no bubble, the busy sum's bits.
        finish = np.array([_one_stage_busy(sp, moe_chunk, dense_chunk, num_moe)])
    elif forward_only:
        finish = simulate_schedule(work, np.zeros_like(work), forward_only=True)
    else:
        finish = simulate_schedule(FORWARD_SHARE * work, (1.0 - FORWARD_SHARE) * work)
    totals = finish + np.array([sum(a) for a in after_of])
    s = int(np.argmax(totals))
    return StageTimes(
        float(totals[s]),
        exposed_all,
        s,
        0.0 if pp == 1 else max(float(finish[s] - busy_of[s]), 0.0),
        float(sp.p2p.sum()),
        tuple(after_of[s]),
    )


def _one_stage_busy(sp: StagePass, moe_chunk: np.ndarray, dense_chunk: np.ndarray, num_moe: int) -> float:
    """The busy seconds of a one-stage pass (``pp = 1``), summed as before the schedule was run (so
    tensor parallelism without a pipeline keep their bits): the MoE layers joined as the cluster says,
    the dense layers, the head, the sends and the spread."""
    moe, _ = _join(sp.comp, sp.comm, sp.overlap, sp.contention)
    nd = len(dense_chunk)
    return (
        moe
        + nd * float(sp.dense.sum())
        + float(sp.head.sum())
        + float(sp.p2p.sum())
        + (1.0 if num_moe else 0.0) * sp.spread
    )
