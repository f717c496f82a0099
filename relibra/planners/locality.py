"""Reordering's second round: re-assign samples to GPUs for data locality (ReLibra, inter-batch stage).

Given the batch's placement ``home`` [L, E], a sample's tokens that route to experts homed on its own node
stay on NVLink; the rest cross the rail fabric. Each sample keeps its micro-batch (``sample_mb`` is fixed);
within a micro-batch, samples move between GPUs so that more of their routed tokens are node-local, while
each GPU's token count stays within a tolerance (so attention and dense time stay balanced).

Per micro-batch this is a generalised assignment problem; it is solved greedily:

1. ``affinity[s, g]``: routed slots of sample ``s`` whose expert is homed on ``g``'s node, plus half the
   slots homed on ``g`` itself (those skip NVLink too);
2. samples in order of decreasing tokens, each onto the GPU of highest affinity whose token count stays
   within ``cap = max(original busiest GPU, (1 + tolerance) * mean)``; if none fits, onto the GPU with the
   fewest tokens;
3. the new assignment is kept only if it lowers the batch's total all-to-all time under the cost model
   (home-only assignment), so the round never makes communication worse.
"""

from __future__ import annotations

import numpy as np

from relibra.planner import BatchContext, home_assign
from relibra.workload import microbatch_loads

__all__ = ["cross_node_tokens", "locality_round", "sample_affinity"]


def sample_affinity(counts: np.ndarray, home: np.ndarray, num_gpus: int, gpus_per_node: int) -> np.ndarray:
    """Routed slots of each sample that would stay local on each GPU.

    counts [Sb, L, E], home [L, E] -> float64 [Sb, G]: slots homed on ``g``'s node plus half those on ``g``.
    """
    counts = np.asarray(counts)
    sb, num_layers, num_experts = counts.shape
    onehot = np.zeros((num_layers, num_experts, num_gpus))
    onehot[np.arange(num_layers)[:, None], np.arange(num_experts)[None, :], home] = 1.0
    on_gpu = np.einsum("sle,leg->sg", counts.astype(np.float64), onehot)  # [Sb, G]
    nodes = num_gpus // gpus_per_node
    on_node = on_gpu.reshape(sb, nodes, gpus_per_node).sum(axis=2)  # [Sb, N]
    return np.repeat(on_node, gpus_per_node, axis=1) + 0.5 * on_gpu


def cross_node_tokens(load: np.ndarray, home: np.ndarray, gpus_per_node: int) -> float:
    """Routed slots that leave their source node under home-only assignment.

    load [Mb, L, G, E], home [L, E] -> total over the batch (one-way dispatch; combine mirrors it).
    """
    load = np.asarray(load)
    g = load.shape[2]
    src_node = np.arange(g) // gpus_per_node  # [G]
    dst_node = np.asarray(home) // gpus_per_node  # [L, E]
    remote = src_node[None, :, None] != dst_node[:, None, :]  # [L, G, E]
    return float((load * remote[None]).sum(dtype=np.float64))


def _assign_microbatch(
    tokens: np.ndarray, affinity: np.ndarray, current: np.ndarray, num_gpus: int, tolerance: float
) -> np.ndarray:
    """Greedy for one micro-batch: tokens [n], affinity [n, G], current GPUs [n] -> new GPUs int32 [n]."""
    before = np.bincount(current, weights=tokens, minlength=num_gpus)
    cap = max(before.max(), (1.0 + tolerance) * before.mean())
    gpu_tokens = np.zeros(num_gpus)
    out = np.empty(tokens.shape[0], dtype=np.int32)
    for s in np.argsort(-tokens, kind="stable"):
        fits = gpu_tokens + tokens[s] <= cap
        if fits.any():
            g = int(np.argmax(np.where(fits, affinity[s], -np.inf)))
        else:
            g = int(np.argmin(gpu_tokens))
        out[s] = g
        gpu_tokens[g] += tokens[s]
    return out


def locality_round(
    ctx: BatchContext, home: np.ndarray, *, tolerance: float = 0.05
) -> tuple[np.ndarray, dict[str, float]]:
    """Re-assign the batch's samples to GPUs (micro-batches fixed) for data locality under ``home`` [L, E].

    Returns (sample_gpu int32 [Sb], stats): ``locality_cross_node_before`` / ``_after`` (routed slots leaving
    their source node, batch total), ``locality_comm_before_s`` / ``_after_s`` (summed all-to-all seconds,
    home-only), ``locality_moved_samples`` and ``locality_applied`` (1.0 when the new assignment was kept).
    """
    g = ctx.num_gpus
    gpn = ctx.cluster.gpus_per_node
    home = np.asarray(home)
    mb = ctx.num_microbatches
    sample_mb = np.asarray(ctx.sample_mb)
    old_gpu = np.asarray(ctx.sample_gpu, dtype=np.int32)
    tokens = np.asarray(ctx.sample_tokens, dtype=np.float64)
    affinity = sample_affinity(ctx.counts, home, g, gpn)
    new_gpu = old_gpu.copy()
    for m in range(mb):
        members = np.flatnonzero(sample_mb == m)
        if members.size:
            new_gpu[members] = _assign_microbatch(
                tokens[members], affinity[members], old_gpu[members], g, tolerance
            )

    old_load = np.asarray(ctx.load)
    if ctx.regroup is not None:
        new_load = ctx.regroup(new_gpu)[0]
    else:
        new_load = microbatch_loads(ctx.counts, new_gpu, sample_mb, mb, g)

    def comm_s(load: np.ndarray) -> float:
        return float(
            ctx.cost.comm_time(ctx.cost.traffic(load, home_assign(load, home, g))).max(axis=-1).sum()
        )

    before, after = comm_s(old_load), comm_s(new_load)
    applied = after < before
    stats = {
        "locality_cross_node_before": cross_node_tokens(old_load, home, gpn),
        "locality_cross_node_after": cross_node_tokens(new_load if applied else old_load, home, gpn),
        "locality_comm_before_s": before,
        "locality_comm_after_s": after if applied else before,
        "locality_moved_samples": float(np.count_nonzero(new_gpu != old_gpu)) if applied else 0.0,
        "locality_applied": float(applied),
    }
    return (new_gpu if applied else old_gpu), stats
