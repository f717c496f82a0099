"""Megatron's EP all-to-all overlap: ``cluster.ep_overlap`` (``overlap_moe_expert_parallel_comm``).

Megatron-core's combined 1F1B schedule (``core.pipeline_parallel.combined_1f1b``) runs the forward of one
micro-batch together with the backward of the previous one, layer by layer: the forward's dispatch and
combine all-to-all hide behind the backward's attention and expert computation, and the backward's
behind the forward's. With ``M`` micro-batches in a step the pairs are ``(F[m + 1], B[m])`` for
``m < M - 1``; the first forward and the last backward run alone, so at least two micro-batches are
needed for any overlap. Per layer and pair:

    t = max(comm_F[m + 1], comp_B[m]) + max(comm_B[m], comp_F[m + 1])

where ``comp`` is the layer's expert GEMMs plus attention of that pass (forward a third of forward plus
backward, backward two thirds, as the cost model counts FLOPs) and ``comm`` its two all-to-all phases
(dispatch and combine; half of the four). What the compute does not cover is the exposed communication.
"""

from __future__ import annotations

import numpy as np

__all__ = ["overlapped_time"]


def overlapped_time(compute: np.ndarray, comm: np.ndarray) -> tuple[float, float]:
    """(seconds of the step's MoE layers, exposed communication seconds) under the combined 1F1B overlap.

    compute [M, L]: forward plus backward seconds of each (micro-batch, layer)'s expert GEMMs and
    attention; comm [M, L]: its four all-to-all phases. Without overlap the time would be
    ``compute.sum() + comm.sum()``; the result never exceeds that, nor falls below ``compute.sum()``.
    """
    comp = np.asarray(compute, dtype=np.float64)
    com = np.asarray(comm, dtype=np.float64)
    if comp.shape[0] < 2:
        raise ValueError(
            f"cluster.ep_overlap needs at least 2 micro-batches in a step to overlap; got {comp.shape[0]}"
        )
    f_comp, b_comp = comp / 3.0, 2.0 * comp / 3.0
    f_comm = b_comm = com / 2.0
    pairs = np.maximum(f_comm[1:], b_comp[:-1]) + np.maximum(b_comm[:-1], f_comp[1:])  # [M - 1, L]
    total = float(pairs.sum() + (f_comp[0] + f_comm[0]).sum() + (b_comp[-1] + b_comm[-1]).sum())
    return total, total - float(comp.sum())
