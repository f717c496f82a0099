"""Small workloads of the shapes the token-imbalance benchmark asks about, for the planners' and baselines'
tests: balanced routing, a whole node hot (the hot set is exactly node 0's experts under Megatron-LM's
static placement), and a hotspot that rotates over the nodes from batch to batch."""

from __future__ import annotations

import numpy as np

from relibra.types import SampleCounts


def hot_set_counts(
    *,
    num_experts: int,
    num_layers: int,
    top_k: int,
    num_gpus: int,
    gpus_per_node: int,
    batches: int,
    tokens: int,
    hot_share: float,
    rotate: bool = False,
    seed: int = 0,
) -> SampleCounts:
    """One ``tokens``-token sample per GPU per batch; every (sample, layer) routes its ``tokens * top_k``
    slots by a multinomial in which one node's ``E * gpus_per_node / G`` experts take ``hot_share`` of the
    slots (node 0, or node ``b % nodes`` in batch ``b`` with ``rotate``) and the rest share the remainder
    evenly.
    ``hot_share = hot / E`` is balanced routing. -> counts [batches * G, L, E]."""
    nodes = num_gpus // gpus_per_node
    hot = num_experts // nodes
    rng = np.random.default_rng(seed)
    parts = []
    for b in range(batches):
        first = (b % nodes if rotate else 0) * hot
        p = np.full(num_experts, (1.0 - hot_share) / (num_experts - hot))
        p[first : first + hot] = hot_share / hot
        parts.append(rng.multinomial(tokens * top_k, p, size=(num_gpus, num_layers)))
    counts = np.concatenate(parts).astype(np.int32)
    return SampleCounts(
        counts=counts,
        tokens=np.full(batches * num_gpus, tokens, dtype=np.int64),
        batch_offsets=np.arange(0, batches * num_gpus + 1, num_gpus, dtype=np.int64),
        top_k=top_k,
        meta={"source": "tests"},
    )
