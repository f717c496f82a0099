"""Context parallelism's key-value exchange (``parallel.cp``, :mod:`relibra.parallel`): the ``p2p`` ring.

Megatron's ``--cp-comm-type`` defaults to ``p2p`` (``megatron/training/arguments.py``), Transformer Engine's
``AttnFuncWithCPAndKVP2P``
(``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``): the ``cp`` ranks of a
sequence form a ring; in ``cp`` steps each rank computes its queries (its two chunks, :mod:`relibra.workload`)
against one rank's keys and values, while it sends the block it holds to the next rank and receives the next
block from the previous one (two CUDA streams: the send of step ``i + 1``'s block runs behind step ``i``'s
attention). The backward runs the same ring and sends the key-value gradients with the blocks, twice the
bytes. Modelled, per attention layer and GPU:

* a step's block is the key-value tensor of the CP rank's tokens for the GPU's heads: ``tp`` times the
  GPU's tokens (sequence parallelism all-gathers the CP rank's tokens before attention) times
  :func:`kv_bytes_per_token` (bf16 K and V of ``ceil(kv_heads / tp)`` heads; with MLA the up-projected
  keys and values of ``num_heads / tp`` heads, which is what Megatron's MLA sends under CP);
* its seconds at the ring's slowest hop: NVLink (``nvlink_bytes_per_s * nvlink_efficiency``) while the TP x
  CP group stays in one NVLink domain, else the rail NIC (``nic_bytes_per_s * nic_efficiency``), since the
  ring then has a hop between nodes; plus ``alltoall_latency_s`` per send (the fabric's one message
  latency);
* overlap: each of the ``cp - 1`` sends hides behind one step of the core attention (``1 / cp`` of the
  GPU's QK^T and PV: the load-balanced split gives every step the same work), only the excess is exposed;
  forward ``FORWARD_FLOPS_SHARE`` of the core attention with the blocks' bytes, backward the rest with
  twice the bytes (:func:`cp_exchange_time`).

The exposed seconds join each layer's attention (:mod:`relibra.cost.passes`), so ``t_attention_s`` holds
them. Not modelled (choices left open): the ``a2a`` (Ulysses) and ``allgather`` types, ``a2a+p2p``
hierarchies, and the SMs the sends take from the attention kernels.
"""

from __future__ import annotations

import math

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.step import FORWARD_FLOPS_SHARE
from relibra.parallel import ParallelDims

__all__ = ["CP_COMM_TYPE", "cp_exchange_time", "kv_bytes_per_token"]

CP_COMM_TYPE = "p2p"
"""The CP communication modelled: Megatron's default ``--cp-comm-type p2p`` (module doc)."""
BF16_BYTES = 2
BACKWARD_BLOCKS = 2
"""Tensors a backward ring step sends per key-value block: the block and its gradient (Transformer Engine's
``AttnFuncWithCPAndKVP2P.backward`` passes ``kv`` and ``dkv`` around the ring)."""


def kv_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """bf16 bytes of one token's keys and values on one GPU of a TP group (module doc)."""
    if model.mla:
        heads, width = model.num_heads, model.qk_head_dim + model.value_head_dim
    else:
        heads, width = model.num_kv_heads, 2 * model.head_dim
    return float(BF16_BYTES * math.ceil(heads / tp) * width)


def cp_exchange_time(
    cluster: ClusterSpec, model: ModelSpec, parallel: ParallelDims, tokens: np.ndarray, core: np.ndarray
) -> np.ndarray:
    """Exposed seconds of one attention layer's ring, fwd + bwd, on the busiest GPU (module doc).

    Args:
        tokens: [..., G] tokens each GPU holds; core: [..., G] its core attention seconds, fwd + bwd.
    Returns:
        float64 [...] (zeros when ``cp = 1``).
    """
    t = np.asarray(tokens, dtype=np.float64)
    cp = parallel.cp
    if cp == 1:
        return np.zeros(t.shape[:-1])
    hw = cluster.hardware
    one_domain = parallel.group <= cluster.domain_gpus
    rate = (
        hw.nvlink_bytes_per_s * hw.nvlink_efficiency if one_domain else hw.nic_bytes_per_s * hw.nic_efficiency
    )
    send = t * parallel.tp * kv_bytes_per_token(model, parallel.tp) / rate + hw.alltoall_latency_s
    step = np.asarray(core, dtype=np.float64) / cp
    fwd = np.maximum(send - FORWARD_FLOPS_SHARE * step, 0.0)
    bwd = np.maximum(BACKWARD_BLOCKS * send - (1.0 - FORWARD_FLOPS_SHARE) * step, 0.0)
    return np.asarray(((cp - 1) * (fwd + bwd)).max(axis=-1))
