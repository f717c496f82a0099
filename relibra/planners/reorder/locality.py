"""Reordering's second round: re-assign samples to GPUs for data locality (ReLibra, inter-batch stage).

Given the batch's placement ``home`` [L, E], the tokens a sample routes to experts homed on its own node
stay on NVLink; the rest cross the rail fabric. The round starts from the run's sample layout (the
``balanced`` layout by default, :mod:`relibra.workload`). Each sample keeps its micro-batch (``sample_mb``
is fixed, so every expert's token count, hence compute, is unchanged); within a micro-batch, samples move
between GPUs so that the all-to-all gets cheaper, but only under a stated balance tolerance ``tol`` in
(0, 1]: no GPU may end above ``max(busiest GPU before, (1 + tol) * mean)`` tokens, nor above the same cap
on attention pairs (:mod:`relibra.attention_span`), so attention and dense time stay as balanced as the
layout made them (up to ``tol``). What the round adds is the ablation's ``+ locality round`` row
(planner=relibra_no_locality is ReLibra without it).

The search is a randomised hill climb per micro-batch on the cost model's communication objective
``sum_l max_g T_comm(g)`` (home-only assignment, rail-optimized routing as in
:func:`relibra.planners.reorder.links.link_routes`):

1. ``per_gpu[s, l, g]``: routed slots of sample ``s`` in layer ``l`` whose expert is homed on ``g``;
2. propose moving a sample to a GPU on another node (or anywhere, with a small probability); if that GPU
   would exceed either cap, swap with one of its samples instead (if the swap keeps both GPUs under both
   caps);
3. update the per-layer link-class loads of the two source GPUs incrementally (O(L * G) per move) and keep
   the change only if the objective drops. The result is never worse than the input assignment.

The incremental objective is ``cluster.dispatcher=alltoall``'s communication without overlap. Under
``deepep`` the climb runs on that proxy and its result is kept only if the cost model's DeepEP
communication of the batch does not grow. Under ``cluster.ep_overlap`` it is kept only if the batch's
home-only MoE time, priced as the simulator prices it (:func:`relibra.cost.overlap.overlapped_time`: the
configured dispatcher's communication, compute with the attention of the new assignment), does not grow;
``locality_reverted`` says whether the guard undid the round. Why a proxy: the climb moves one sample at a
time within a micro-batch and updates O(L * G) link loads per move; DeepEP's estimate needs the per-source
miss probabilities of every (layer, GPU) pair (O(L * G^2) per move), and the overlap couples a micro-batch
to its neighbours, so its exact price per move would re-evaluate the neighbours' pairs too. Fewer tokens
crossing nodes lowers every dispatcher's traffic, and the guard makes the round never worse by the true
price (``tests/cost/test_overlap.py``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from relibra.cost.overlap import overlapped_time
from relibra.cost.pricing import attention_window
from relibra.planners.protocols import BatchContext, home_assign
from relibra.planners.reorder.links import NUM_LINKS, comm_coefficients, comm_gpu, link_routes
from relibra.workload import microbatch_loads

__all__ = ["cross_node_tokens", "locality_round", "per_gpu_slots"]


def per_gpu_slots(counts: np.ndarray, home: np.ndarray, num_gpus: int) -> np.ndarray:
    """Routed slots of each sample per layer per home GPU.

    counts [Sb, L, E], home [L, E] (``E / G`` experts per GPU) -> float64 [Sb, L, G].
    """
    counts = np.asarray(counts)
    sb, num_layers, num_experts = counts.shape
    order = np.argsort(np.asarray(home), axis=1, kind="stable")  # [L, E], experts grouped by home GPU
    grouped = np.take_along_axis(counts, order[None], axis=2)  # [Sb, L, E]
    per = num_experts // num_gpus
    return grouped.reshape(sb, num_layers, num_gpus, per).sum(axis=3, dtype=np.float64)


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


@njit(cache=True)
def _link_state(traffic: np.ndarray, idx: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """traffic [L, G(j), G(g)] tokens -> per-layer link-class loads [L, 8 * G]."""
    num_layers, g_total, _ = traffic.shape
    link = np.zeros((num_layers, NUM_LINKS * g_total))
    for l in range(num_layers):
        for j in range(g_total):
            for g in range(g_total):
                v = traffic[l, j, g]
                if v != 0.0:
                    for k in range(cnt[j, g]):
                        link[l, idx[j, g, k]] += v
    return link


@njit(cache=True)
def _move(slots: np.ndarray, u: int, v: int, link: np.ndarray, idx: np.ndarray, cnt: np.ndarray) -> None:
    """Move one sample's traffic (slots [L, G] per home GPU) from source GPU ``u`` to ``v``."""
    num_layers, g_total = slots.shape
    for l in range(num_layers):
        for g in range(g_total):
            c = slots[l, g]
            if c != 0.0:
                for k in range(cnt[u, g]):
                    link[l, idx[u, g, k]] -= c
                for k in range(cnt[v, g]):
                    link[l, idx[v, g, k]] += c


@njit(cache=True)
def _comm_total(link: np.ndarray, coef: np.ndarray, g_total: int) -> float:
    """sum over layers of max over GPUs of the all-to-all seconds."""
    total = 0.0
    for l in range(link.shape[0]):
        mx = 0.0
        for g in range(g_total):
            v = comm_gpu(link[l], g, g_total, coef)
            if v > mx:
                mx = v
        total += mx
    return total


@njit(cache=True)
def _hill_climb(
    gpu: np.ndarray,
    tokens: np.ndarray,
    pairs: np.ndarray,
    slots: np.ndarray,
    link: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    coef: np.ndarray,
    gpus_per_node: int,
    cap: float,
    cap_pairs: float,
    iterations: int,
    cross_node_prob: float,
    rng: np.random.Generator,
) -> float:
    """Improve ``gpu`` [n] in place for one micro-batch; ``tokens`` [n], ``pairs`` [n] (causal attention
    pairs), ``slots`` [n, L, G]; no GPU may end above ``cap`` tokens or ``cap_pairs`` pairs. Returns the
    final objective."""
    n = gpu.shape[0]
    g_total = link.shape[1] // NUM_LINKS
    nodes = g_total // gpus_per_node
    gpu_tokens = np.zeros(g_total)
    gpu_pairs = np.zeros(g_total)
    for i in range(n):
        gpu_tokens[gpu[i]] += tokens[i]
        gpu_pairs[gpu[i]] += pairs[i]
    cur = _comm_total(link, coef, g_total)
    if n == 0 or g_total < 2:
        return cur
    for _ in range(iterations):
        s = rng.integers(0, n)
        u = gpu[s]
        if nodes > 1 and rng.random() < cross_node_prob:
            nd = rng.integers(0, nodes - 1)
            if nd >= u // gpus_per_node:
                nd += 1
            v = int(nd * gpus_per_node + rng.integers(0, gpus_per_node))
        else:
            v = int(rng.integers(0, g_total - 1))
            if v >= u:
                v += 1
        t = -1
        if gpu_tokens[v] + tokens[s] > cap or gpu_pairs[v] + pairs[s] > cap_pairs:
            on_v = 0
            for r in range(n):
                if gpu[r] == v:
                    on_v += 1
            if on_v == 0:
                continue
            pick = rng.integers(0, on_v)
            for r in range(n):
                if gpu[r] == v:
                    if pick == 0:
                        t = r
                        break
                    pick -= 1
            if gpu_tokens[v] - tokens[t] + tokens[s] > cap or gpu_tokens[u] - tokens[s] + tokens[t] > cap:
                continue
            if (
                gpu_pairs[v] - pairs[t] + pairs[s] > cap_pairs
                or gpu_pairs[u] - pairs[s] + pairs[t] > cap_pairs
            ):
                continue
        _move(slots[s], u, v, link, idx, cnt)
        if t >= 0:
            _move(slots[t], v, u, link, idx, cnt)
        new = _comm_total(link, coef, g_total)
        if new < cur * (1.0 - 1e-12):
            cur = new
            gpu[s] = v
            gpu_tokens[u] -= tokens[s]
            gpu_tokens[v] += tokens[s]
            gpu_pairs[u] -= pairs[s]
            gpu_pairs[v] += pairs[s]
            if t >= 0:
                gpu[t] = u
                gpu_tokens[v] -= tokens[t]
                gpu_tokens[u] += tokens[t]
                gpu_pairs[v] -= pairs[t]
                gpu_pairs[u] += pairs[t]
        else:
            _move(slots[s], v, u, link, idx, cnt)
            if t >= 0:
                _move(slots[t], u, v, link, idx, cnt)
    return cur


def locality_round(
    ctx: BatchContext,
    home: np.ndarray,
    *,
    tolerance: float = 0.05,
    iterations_per_sample: int = 10,
    cross_node_prob: float = 0.8,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, float]]:
    """Re-assign the batch's samples to GPUs (micro-batches fixed) for data locality under ``home`` [L, E].

    Returns (sample_gpu int32 [Sb], stats): ``locality_cross_node_before`` / ``_after`` (routed slots leaving
    their source node, batch total), ``locality_comm_before_s`` / ``_after_s`` (summed all-to-all seconds,
    home-only, from the cost model) and ``locality_moved_samples``.
    """
    if not 0 < tolerance <= 1:
        raise ValueError(f"locality tolerance={tolerance}; expected a value in (0, 1]")
    if ctx.cost.parallel.group > 1:
        # NOTE: a sample's rows are the ranks of one TP x CP group (relibra.workload); the climb moves one row
        # at a time, which would split a group, so under tp * cp > 1 nothing moves (docs/parallel.md).
        return np.asarray(ctx.sample_gpu, dtype=np.int32), {"locality_moved_samples": 0.0}
    g = ctx.num_gpus
    gpn = ctx.cluster.domain_gpus
    home = np.asarray(home)
    mb = ctx.num_microbatches
    sample_mb = np.asarray(ctx.sample_mb)
    old_gpu = np.asarray(ctx.sample_gpu, dtype=np.int32)
    tokens = np.asarray(ctx.sample_tokens, dtype=np.float64)
    pairs = ctx.model.attention_span.pairs(ctx.sample_tokens)
    load = np.asarray(ctx.load)
    coef = comm_coefficients(ctx.cost)
    idx, cnt = link_routes(ctx.cluster.num_domains, gpn)
    slots = per_gpu_slots(ctx.counts, home, g)  # [Sb, L, G]
    rng = np.random.default_rng(np.random.SeedSequence([seed, ctx.seed, ctx.batch]))
    new_gpu = old_gpu.copy()
    for m in range(mb):
        members = np.flatnonzero(sample_mb == m)
        if members.size == 0:
            continue
        before = np.bincount(old_gpu[members], weights=tokens[members], minlength=g)
        cap = max(float(before.max()), (1.0 + tolerance) * float(before.mean()))
        before_pairs = np.bincount(old_gpu[members], weights=pairs[members], minlength=g)
        cap_pairs = max(float(before_pairs.max()), (1.0 + tolerance) * float(before_pairs.mean()))
        # load[m] [L, G(j), E] grouped by home GPU -> traffic [L, G(j), G(g)]
        t_m = per_gpu_slots(load[m].transpose(1, 0, 2), home, g).transpose(1, 0, 2)
        link = _link_state(np.ascontiguousarray(t_m), idx, cnt)
        gpu_m = new_gpu[members].astype(np.int64)
        _hill_climb(
            gpu_m,
            tokens[members],
            pairs[members],
            np.ascontiguousarray(slots[members]),
            link,
            idx,
            cnt,
            coef,
            gpn,
            cap,
            cap_pairs,
            iterations_per_sample * members.size,
            cross_node_prob,
            rng,
        )
        new_gpu[members] = gpu_m

    new_load = (
        ctx.regroup(new_gpu)[0]
        if ctx.regroup is not None
        else microbatch_loads(ctx.counts, new_gpu, sample_mb, mb, g)
    )

    def comm_s(x: np.ndarray) -> float:
        return float(ctx.cost.moe_comm_time(x, home_assign(x, home, g)).max(axis=-1).sum())

    before_s, after_s = comm_s(load), comm_s(new_load)
    guarded = ctx.cost.dispatcher != "alltoall" or ctx.cost.cluster.ep_overlap
    reverted = False
    if guarded:
        # NOTE: the hill climb's incremental objective is alltoall's communication without overlap; under
        # another dispatcher or the overlap keep its result only where the cost model's own price agrees.
        if ctx.cost.cluster.ep_overlap:
            reverted = _overlapped(ctx, new_load, home, new_gpu) > _overlapped(ctx, load, home, old_gpu)
        else:
            reverted = after_s > before_s
        if reverted:
            new_gpu, new_load, after_s = old_gpu.copy(), load, before_s
    stats = {
        "locality_cross_node_before": cross_node_tokens(load, home, gpn),
        "locality_cross_node_after": cross_node_tokens(new_load, home, gpn),
        "locality_comm_before_s": before_s,
        "locality_comm_after_s": after_s,
        "locality_moved_samples": float(np.count_nonzero(new_gpu != old_gpu)),
    }
    if guarded:
        stats["locality_reverted"] = float(reverted)
    return new_gpu, stats


def _overlapped(ctx: BatchContext, load: np.ndarray, home: np.ndarray, sample_gpu: np.ndarray) -> float:
    """Seconds of the batch's MoE layers with every expert at home under ``cluster.ep_overlap``
    (:func:`relibra.cost.overlap.overlapped_time`: compute with the attention of ``sample_gpu`` [Sb], the
    dispatcher's communication), as the simulator prices the home-only plan; load [Mb, L, G, E]."""
    br = ctx.cost.moe(load, home_assign(load, home, ctx.num_gpus))
    attention = attention_window(ctx, sample_gpu)[:, None]  # [Mb, 1]
    return overlapped_time(br.t_compute + attention, br.t_comm, ctx.cost.cluster.comm_sm_share)[0]
