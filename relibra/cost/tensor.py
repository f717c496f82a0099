"""Tensor parallelism inside one stage's EP group (``parallel.tp``, :mod:`relibra.parallel`).

The EP group's ``G`` GPUs are ``G / tp`` tensor-parallel groups of ``tp`` consecutive GPUs (one node's
NVLink). Megatron runs MoE with tensor parallelism under sequence parallelism, so each GPU holds ``1 / tp``
of its group's tokens: the tokens it norms, routes, permutes and dispatches (with ``etp = 1`` the experts
are not split and the dispatcher needs no tensor-parallel collective). The harness's sample layout gives
each GPU whole samples; a tensor-parallel group's micro-batch is the union of its ``tp`` GPUs' samples.

* The GEMMs tensor parallelism splits (attention projections and core attention, shared experts, dense
  FFNs, the LM head and the vocabulary-parallel loss) do the group's work ``tp`` ways: each GPU of a group
  spends the **mean** of its GPUs' full-width seconds (:func:`tp_group_mean`).
* Each tensor-parallel block (a layer's attention, a dense layer's FFN, a MoE layer's shared experts, the
  LM head) runs, per micro-batch, fwd + bwd, :data:`TP_EXPOSED_COLLECTIVES` ring collectives over the
  group on NVLink (:func:`tp_block_time`), each moving ``(tp - 1)`` shards of ``tokens x hidden`` bf16 per
  GPU, plus the collective latency.
"""

from __future__ import annotations

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec

__all__ = ["TP_EXPOSED_COLLECTIVES", "tp_block_time", "tp_group_mean"]

BF16_BYTES = 2
TP_EXPOSED_COLLECTIVES = 3
"""Exposed ring collectives per tensor-parallel block, fwd + bwd, under sequence parallelism. Megatron's
``LinearWithGradAccumulationAndAsyncCommunication`` (``megatron/core/tensor_parallel/layers.py``): forward
all-gathers the input (column-parallel) and reduce-scatters the output (row-parallel); backward all-gathers
the output gradient (the reduce-scatter's backward), re-gathers the input for the weight gradient and
reduce-scatters the input gradient, those last two with ``async_op=True`` behind the gradient GEMMs. The
three blocking ones are exposed (Megatron-Bridge's Qwen3-235B-A22B H100 recipe sets
``tp_comm_overlap=False``); Korthikanti et al. 2022 (arXiv 2205.05198, Section 4.2.2) count the same
traffic as tensor parallelism's all-reduces."""


def tp_group_mean(x: np.ndarray, tp: int) -> np.ndarray:
    """Per tensor-parallel group, the mean of its GPUs' values: x [..., G] -> float64 [..., G / tp]
    (``x`` itself when ``tp == 1``)."""
    if tp == 1:
        return np.asarray(x)
    a = np.asarray(x, dtype=np.float64)
    return np.asarray(a.reshape(*a.shape[:-1], a.shape[-1] // tp, tp).mean(axis=-1))


def tp_block_time(cluster: ClusterSpec, model: ModelSpec, tp: int, tokens: np.ndarray) -> np.ndarray:
    """Seconds of one tensor-parallel block's exposed collectives, fwd + bwd, on the busiest GPU:
    tokens [..., G] each GPU holds -> [...] (0 when ``tp == 1``).

    A ring all-gather or reduce-scatter over ``tp`` GPUs sends ``(tp - 1)`` shards of the GPU's
    ``tokens x hidden`` bf16 values over NVLink at ``nvlink_bytes_per_s * nvlink_efficiency``, plus
    ``alltoall_latency_s``; the group waits for its largest shard.
    """
    t = np.asarray(tokens, dtype=np.float64)
    if tp == 1:
        return np.zeros(t.shape[:-1])
    hw = cluster.hardware
    rate = hw.nvlink_bytes_per_s * hw.nvlink_efficiency
    shard = t.max(axis=-1) * model.hidden * BF16_BYTES
    return np.asarray(TP_EXPOSED_COLLECTIVES * ((tp - 1) * shard / rate + hw.alltoall_latency_s))
