"""The annealer's numba kernels: the link and compute state of a placement, its incremental update on a
swap (all-to-all and DeepEP), the smoothed and true objectives (sum or overlapped), and the annealing loop
of one layer and one seed (:func:`anneal_layer`)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from relibra.cluster import ClusterSpec
from relibra.cost.overlap import layer_time
from relibra.planners.reorder.config import AnnealConfig, main_iterations
from relibra.planners.reorder.links import NUM_LINKS, comm_gpu, deepep_routes, fabric_routes
from relibra.planners.reorder.problem import LayerProblem
from relibra.planners.reorder.rail import full_state_rail, home_compute, rail_swap_links


# ------------------------------------------------------------------------------------ numba kernels
@njit(cache=True)
def full_state(
    home: np.ndarray, x: np.ndarray, w: np.ndarray, idx: np.ndarray, cnt: np.ndarray, mig: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-GPU state from scratch: comp [Mb, G], link [Mb, 8 * G] (tokens), migration [G]."""
    mb, e_total, g_total = x.shape
    comp, migr = home_compute(home, w, mig)
    link = np.zeros((mb, NUM_LINKS * g_total))
    for e in range(e_total):
        g = home[e]
        for m in range(mb):
            for j in range(g_total):
                v = x[m, e, j]
                if v != 0.0:
                    for k in range(cnt[j, g]):
                        link[m, idx[j, g, k]] += v
    return comp, link, migr


@njit(cache=True)
def full_state_deepep(
    home: np.ndarray,
    lq: np.ndarray,
    tok: np.ndarray,
    w: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    nodes: int,
    mig: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``deepep`` state from scratch: comp [Mb, G], link [Mb, 8 * G], migration [G], and the estimate's miss
    probabilities [Mb, G(j), G(g)] and [Mb, G(j), N] (a token of j misses GPU g / node n; it reaches it
    with ``tok[j] * (1 - miss)`` tokens)."""
    gidx, gcnt, nidx, ncnt = droutes
    mb, e_total, g_total = lq.shape
    gpn = g_total // nodes
    comp = np.zeros((mb, g_total))
    link = np.zeros((mb, NUM_LINKS * g_total))
    migr = np.zeros(g_total)
    lg = np.zeros((mb, g_total, g_total))
    ln = np.zeros((mb, g_total, nodes))
    for e in range(e_total):
        g = home[e]
        migr[g] += mig[e, g]
        for m in range(mb):
            comp[m, g] += w[m, e]
            for j in range(g_total):
                lg[m, j, g] += lq[m, e, j]
                ln[m, j, g // gpn] += lq[m, e, j]
    for m in range(mb):
        for j in range(g_total):
            t = tok[m, j]
            for g in range(g_total):
                v = -t * math.expm1(lg[m, j, g])
                lg[m, j, g] = math.exp(lg[m, j, g])
                for k in range(gcnt[j, g]):
                    link[m, gidx[j, g, k]] += v
            for n in range(nodes):
                v = -t * math.expm1(ln[m, j, n])
                ln[m, j, n] = math.exp(ln[m, j, n])
                for k in range(ncnt[j, n]):
                    link[m, nidx[j, n, k]] += v
    return comp, link, migr, lg, ln


@njit(cache=True, inline="always")
def _move_deepep(
    m: int,
    j: int,
    col: int,
    f: float,
    miss: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    t: float,
    link: np.ndarray,
) -> None:
    """Scale the miss probability ``miss[m, j, col]`` by ``f`` and add its token change to the links."""
    old = miss[m, j, col]
    new = old * f
    miss[m, j, col] = new
    v = t * (old - new)
    for k in range(cnt[j, col]):
        link[m, idx[j, col, k]] += v


@njit(cache=True)
def _apply_swap_deepep(
    a: int,
    b: int,
    p: int,
    q: int,
    lq: np.ndarray,
    tok: np.ndarray,
    w: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    nodes: int,
    mig: np.ndarray,
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
    lg: np.ndarray,
    ln: np.ndarray,
) -> None:
    """:func:`_apply_swap` for the ``deepep`` estimate: O(Mb * G) updates of the miss probabilities ``lg``
    (per GPU) and ``ln`` (per node) and of their links."""
    gidx, gcnt, nidx, ncnt = droutes
    mb, _, g_total = lq.shape
    gpn = g_total // nodes
    np_, nq = p // gpn, q // gpn
    migr[p] += mig[b, p] - mig[a, p]
    migr[q] += mig[a, q] - mig[b, q]
    for m in range(mb):
        dw = w[m, b] - w[m, a]
        comp[m, p] += dw
        comp[m, q] -= dw
        for j in range(g_total):
            d = lq[m, b, j] - lq[m, a, j]
            if d != 0.0:
                t = tok[m, j]
                f = math.exp(d)  # one exp per (micro-batch, source): miss probabilities scale by f, 1 / f
                _move_deepep(m, j, p, f, lg, gidx, gcnt, t, link)
                _move_deepep(m, j, q, 1.0 / f, lg, gidx, gcnt, t, link)
                if np_ != nq:
                    _move_deepep(m, j, np_, f, ln, nidx, ncnt, t, link)
                    _move_deepep(m, j, nq, 1.0 / f, ln, nidx, ncnt, t, link)


@njit(cache=True)
def _undo_miss_deepep(
    a: int, b: int, p: int, q: int, lq: np.ndarray, nodes: int, lg: np.ndarray, ln: np.ndarray
) -> None:
    """Undo :func:`_apply_swap_deepep` ``(a, b, p, q)`` on the miss probabilities alone, by the arithmetic of
    ``_apply_swap_deepep(b, a, p, q, ...)`` (the same numbers); a rejected proposal's scratch copies of the
    compute, link and migration state are discarded, so their updates would be wasted work."""
    mb, _, g_total = lq.shape
    gpn = g_total // nodes
    np_, nq = p // gpn, q // gpn
    for m in range(mb):
        for j in range(g_total):
            d = lq[m, a, j] - lq[m, b, j]
            if d != 0.0:
                f = math.exp(d)
                g = 1.0 / f
                lg[m, j, p] = lg[m, j, p] * f
                lg[m, j, q] = lg[m, j, q] * g
                if np_ != nq:
                    ln[m, j, np_] = ln[m, j, np_] * f
                    ln[m, j, nq] = ln[m, j, nq] * g


@njit(cache=True, inline="always")
def _no_comm(coef: np.ndarray) -> bool:
    """Whether the communication term weighs nothing (``comm_weight=0``: every coefficient is 0)."""
    return coef[0] == 0.0 and coef[1] == 0.0 and coef[2] == 0.0 and coef[3] == 0.0 and coef[4] == 0.0


@njit(cache=True, inline="always")
def _exp_sum(values: np.ndarray, vmax: float, beta: float) -> float:
    """``sum_i exp(beta * (values[i] - vmax))``, the sum inside an LSE smoothed max (``vmax``: the max)."""
    total = 0.0
    for i in range(values.shape[0]):
        u = beta * (values[i] - vmax)
        # NOTE: terms below exp(-40) cannot change a float64 sum that already holds 1.0.
        if u > -40.0:
            total += math.exp(u)
    return total


@njit(cache=True, inline="always")
def _comm_term(
    link_m: np.ndarray, coef: np.ndarray, beta: float, comm: np.ndarray
) -> tuple[float, int, float]:
    """One micro-batch's communication term: (max over GPUs, its GPU, the LSE sum ``sum_g exp(beta * (c_g -
    max))``) of the all-to-all times from the link loads ``link_m`` [8 * G]; ``comm`` [G] is scratch."""
    g_total = comm.shape[0]
    kmax = -1.0
    ka = 0
    for g in range(g_total):
        v = comm_gpu(link_m, g, g_total, coef)
        comm[g] = v
        if v > kmax:
            kmax = v
            ka = g
    return kmax, ka, _exp_sum(comm, kmax, beta)


@njit(cache=True, inline="always")
def _scratch_size(mb: int, g_total: int) -> int:
    """Length of :func:`_evaluate`'s scratch for ``mb`` rows on ``g_total`` GPUs."""
    return 2 * g_total + 4 * mb


@njit(cache=True)
def _evaluate(
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
    coef: np.ndarray,
    beta: float,
    arg: np.ndarray,
    group: int,
    attn: np.ndarray,
    overlap_mbs: int,
    contention: float,
    scratch: np.ndarray | None = None,
) -> tuple[float, float]:
    """(true, smoothed) normalised objective; writes each micro-batch's bottleneck GPUs to ``arg`` [Mb, 2];
    ``scratch`` [:func:`_scratch_size`] is working memory (the annealer passes one rather than have a new one
    allocated per call).

    The compute term is the max over groups of ``group`` consecutive GPUs of their mean compute (``group=1``:
    the per-GPU max; ``group=gpus_per_node``: the per-node mean); its bottleneck GPU is the busiest GPU of
    the bottleneck group. O(G) per micro-batch. ``overlap_mbs == 0``: the rows' ``T_MoE`` summed; else the
    rows' compute plus attention ``attn`` [Mb] and communication combined by
    :func:`relibra.cost.overlap.layer_time` over ``overlap_mbs`` micro-batches with the all-to-all's SM
    share ``contention`` (its pair maxima smoothed at ``beta`` too in the smoothed value).
    """
    mb, g_total = comp.shape
    if scratch is None:
        scratch = np.empty(_scratch_size(mb, g_total))
    n_groups = g_total // group
    comm = scratch[:g_total]
    cgrp = scratch[g_total : g_total + n_groups]
    true = 0.0
    smooth = 0.0
    rows = mb if overlap_mbs > 0 else 0
    at = 2 * g_total
    rows_c = scratch[at : at + rows]
    rows_k = scratch[at + rows : at + 2 * rows]
    smooth_c = scratch[at + 2 * rows : at + 3 * rows]
    smooth_k = scratch[at + 3 * rows : at + 4 * rows]
    no_comm = _no_comm(coef)
    for m in range(mb):
        cmax = -1.0
        ca = 0
        for n in range(n_groups):
            s = 0.0
            top = -1.0
            tg = n * group
            for g in range(n * group, (n + 1) * group):
                s += comp[m, g]
                if comp[m, g] > top:
                    top = comp[m, g]
                    tg = g
            s /= group
            cgrp[n] = s
            if s > cmax:
                cmax = s
                ca = tg
        sc = _exp_sum(cgrp, cmax, beta)
        if no_comm:
            # NOTE: every GPU's term is exactly 0 (comm_weight=0), so the loops would find GPU 0 the
            # bottleneck and sum G exact ones: the same values without reading the links.
            kmax, ka, sk = 0.0, 0, float(g_total)
        else:
            kmax, ka, sk = _comm_term(link[m], coef, beta, comm)
        if overlap_mbs > 0:
            rows_c[m] = cmax + attn[m]
            rows_k[m] = kmax
            smooth_c[m] = cmax + attn[m] + math.log(sc) / beta
            smooth_k[m] = kmax + math.log(sk) / beta
        else:
            true += cmax + kmax
            smooth += cmax + kmax + (math.log(sc) + math.log(sk)) / beta
        arg[m, 0] = ca
        arg[m, 1] = ka
    if overlap_mbs > 0:
        true = layer_time(rows_c, rows_k, overlap_mbs, math.inf, contention)
        smooth = layer_time(smooth_c, smooth_k, overlap_mbs, beta, contention)
    mmax = 0.0
    for g in range(g_total):
        if migr[g] > mmax:
            mmax = migr[g]
    return true + mmax, smooth + mmax


@njit(cache=True)
def _swap_compute(
    a: int, b: int, p: int, q: int, w: np.ndarray, mig: np.ndarray, comp: np.ndarray, migr: np.ndarray
) -> None:
    """The compute and migration part of :func:`_apply_swap`: O(Mb)."""
    migr[p] += mig[b, p] - mig[a, p]
    migr[q] += mig[a, q] - mig[b, q]
    for m in range(w.shape[0]):
        dw = w[m, b] - w[m, a]
        comp[m, p] += dw
        comp[m, q] -= dw


@njit(cache=True)
def _apply_swap(
    a: int,
    b: int,
    p: int,
    q: int,
    x: np.ndarray,
    w: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    mig: np.ndarray,
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
) -> None:
    """Move expert ``a`` from GPU ``p`` to ``q`` and ``b`` from ``q`` to ``p``: O(Mb * G) state update."""
    mb, _, g_total = x.shape
    _swap_compute(a, b, p, q, w, mig, comp, migr)
    for m in range(mb):
        for j in range(g_total):
            d = x[m, b, j] - x[m, a, j]
            if d != 0.0:
                for k in range(cnt[j, p]):
                    link[m, idx[j, p, k]] += d
                for k in range(cnt[j, q]):
                    link[m, idx[j, q, k]] -= d


@njit(cache=True)
def _anneal_kernel(
    home0: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    mig: np.ndarray,
    coef: np.ndarray,
    gpus_per_node: int,
    iterations: int,
    rng: np.random.Generator,
    beta_start: float,
    beta_end: float,
    beta_stages: int,
    t_start: float,
    t_end: float,
    cross_node_prob: float,
    guided_prob: float,
    group: int,
    lq: np.ndarray,
    tok: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    attn: np.ndarray,
    overlap_mbs: int,
    contention: float,
    integral: bool,
) -> tuple[np.ndarray, float, float, int]:
    """Anneal one layer from ``home0`` [E] (``integral``: ``LayerProblem.integral``, whole-number loads take
    the route-class path). Returns (best home, best true objective, start true, accepted)."""
    mb, e_total, g_total = x.shape
    per_gpu = e_total // g_total
    nodes = g_total // gpus_per_node
    home = home0.copy()
    slots = np.empty((g_total, per_gpu), dtype=np.int64)
    pos = np.empty(e_total, dtype=np.int64)
    fill = np.zeros(g_total, dtype=np.int64)
    for e in range(e_total):
        g = home[e]
        slots[g, fill[g]] = e
        pos[e] = fill[g]
        fill[g] += 1
    deepep = lq.size > 0
    # NOTE: with comm_weight=0 the objective never reads the link loads (_evaluate), so an alltoall search
    # stops updating them: the same proposals, acceptances and placements, without the link work per swap.
    skip_links = _no_comm(coef) and not deepep
    integral = integral and not deepep
    if deepep:
        comp, link, migr, lg, ln = full_state_deepep(home, lq, tok, w, droutes, nodes, mig)
    else:
        if integral:
            comp, link, migr = full_state_rail(home, x, w, gpus_per_node, mig)
        else:
            comp, link, migr = full_state(home, x, w, idx, cnt, mig)
        lg = np.zeros((mb, 0, 0))
        ln = np.zeros((mb, 0, 0))
    # NOTE: in place where the links are whole numbers or untracked: a rejected proposal is undone exactly
    # (compute and migration entries restored, links by the inverse update of reorder.rail), no state copy.
    in_place = skip_links or integral
    prox = np.zeros(nodes + gpus_per_node)
    old_p = np.empty(mb)
    old_q = np.empty(mb)
    comp2 = comp.copy()
    link2 = link.copy()
    migr2 = migr.copy()
    arg = np.zeros((mb, 2), dtype=np.int64)
    scratch = np.empty(_scratch_size(mb, g_total))
    arg_new = np.zeros((mb, 2), dtype=np.int64)
    beta = beta_start
    true0, cur = _evaluate(comp, link, migr, coef, beta, arg, group, attn, overlap_mbs, contention, scratch)
    best = true0
    best_home = home.copy()
    if g_total < 2 or iterations == 0:
        return best_home, best, true0, 0
    t_scale = max(cur, 1e-12)
    accepted = 0
    stage_len = max(1, iterations // beta_stages)
    for it in range(iterations):
        frac = it / iterations
        if it % stage_len == 0 and it > 0:
            beta = beta_start * (beta_end / beta_start) ** frac
            _, cur = _evaluate(
                comp, link, migr, coef, beta, arg, group, attn, overlap_mbs, contention, scratch
            )
        temp = t_scale * t_start * (t_end / t_start) ** frac
        # Step 1: the first expert, from a bottleneck GPU (guided) or uniformly.
        if rng.random() < guided_prob:
            p = arg[rng.integers(0, mb), rng.integers(0, 2)]
            a = slots[p, rng.integers(0, per_gpu)]
        else:
            a = rng.integers(0, e_total)
            p = home[a]
        # Step 2: the partner GPU, preferably on another node.
        if nodes > 1 and rng.random() < cross_node_prob:
            node_p = p // gpus_per_node
            nd = rng.integers(0, nodes - 1)
            if nd >= node_p:
                nd += 1
            q = nd * gpus_per_node + rng.integers(0, gpus_per_node)
        else:
            q = rng.integers(0, g_total - 1)
            if q >= p:
                q += 1
        b = slots[q, rng.integers(0, per_gpu)]
        # Step 3: incremental update (in place, or of a scratch copy), Metropolis acceptance on the smoothed
        # objective.
        if in_place:
            for m in range(mb):
                old_p[m] = comp[m, p]
                old_q[m] = comp[m, q]
            mig_p = migr[p]
            mig_q = migr[q]
            _swap_compute(a, b, p, q, w, mig, comp, migr)
            if not skip_links:
                rail_swap_links(a, b, p, q, x, gpus_per_node, link, prox)
            new_true, new = _evaluate(
                comp, link, migr, coef, beta, arg_new, group, attn, overlap_mbs, contention, scratch
            )
        else:
            comp2[:, :] = comp
            link2[:, :] = link
            migr2[:] = migr
            if deepep:
                # NOTE: the miss probabilities are O(Mb * G^2): updated in place and undone on rejection
                # rather than copied every proposal (the scratch copies carry the O(Mb * G) rest).
                _apply_swap_deepep(a, b, p, q, lq, tok, w, droutes, nodes, mig, comp2, link2, migr2, lg, ln)
            else:
                _apply_swap(a, b, p, q, x, w, idx, cnt, mig, comp2, link2, migr2)
            new_true, new = _evaluate(
                comp2, link2, migr2, coef, beta, arg_new, group, attn, overlap_mbs, contention, scratch
            )
        delta = new - cur
        if delta <= 0.0 or rng.random() < math.exp(-delta / temp):
            if not in_place:
                comp, comp2 = comp2, comp
                link, link2 = link2, link
                migr, migr2 = migr2, migr
            accepted += 1
            cur = new
            home[a] = q
            home[b] = p
            pa = pos[a]
            pb = pos[b]
            slots[q, pb] = a
            slots[p, pa] = b
            pos[a] = pb
            pos[b] = pa
            arg[:, :] = arg_new
            if new_true < best:
                best = new_true
                best_home[:] = home
        elif in_place:  # undo: a back to p, b back to q
            for m in range(mb):
                comp[m, p] = old_p[m]
                comp[m, q] = old_q[m]
            migr[p] = mig_p
            migr[q] = mig_q
            if not skip_links:
                rail_swap_links(b, a, p, q, x, gpus_per_node, link, prox)
        elif deepep:  # undo the in-place miss-probability update (a back to p, b back to q)
            _undo_miss_deepep(a, b, p, q, lq, nodes, lg, ln)
    return best_home, best, true0, accepted


_NO_DROUTES = (
    np.zeros((0, 0, 4), dtype=np.int32),
    np.zeros((0, 0), dtype=np.int32),
    np.zeros((0, 0, 4), dtype=np.int32),
    np.zeros((0, 0), dtype=np.int32),
)


def _droutes(
    problem: LayerProblem, cluster: ClusterSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`deepep_routes` for a ``deepep`` problem, empty arrays otherwise (the kernels' typing)."""
    return deepep_routes(cluster.num_domains, cluster.domain_gpus) if problem.deepep else _NO_DROUTES


def anneal_layer(
    problem: LayerProblem,
    home0: np.ndarray,
    cluster: ClusterSpec,
    config: AnnealConfig,
    seed: int,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, float, float]:
    """Anneal one layer from ``home0`` [E] with one seed.

    ``routes``: None, or ``link_routes(cluster.num_domains, cluster.domain_gpus)`` (others are refused:
    :func:`~relibra.planners.reorder.links.fabric_routes`).
    Returns (best home int32 [E], its true objective in seconds, the start's true objective in seconds).
    """
    idx, cnt = fabric_routes(routes, cluster.num_domains, cluster.domain_gpus)
    best_home, best, start, _ = _anneal_kernel(
        np.asarray(home0, dtype=np.int64),
        problem.x,
        problem.w,
        idx,
        cnt,
        problem.mig,
        problem.coef,
        cluster.domain_gpus,
        main_iterations(config, problem.x.shape[0], problem.x.shape[2]),
        np.random.default_rng(seed),
        config.beta_start,
        config.beta_end,
        config.beta_stages,
        config.temperature_start,
        config.temperature_end,
        config.cross_node_prob,
        config.guided_prob,
        problem.compute_group,
        problem.lq,
        problem.tok,
        _droutes(problem, cluster),
        problem.attn,
        problem.overlap_mbs,
        problem.contention,
        problem.integral,
    )
    return best_home.astype(np.int32), best * problem.scale, start * problem.scale


def placement_objective(
    problem: LayerProblem,
    home: np.ndarray,
    cluster: ClusterSpec,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """True objective in seconds of placement ``home`` [E]: the sum of the micro-batches' ``T_MoE``, or under
    ``cluster.ep_overlap`` the overlapped layer time (:func:`relibra.cost.overlap.layer_time`), plus the
    migration term."""
    idx, cnt = fabric_routes(routes, cluster.num_domains, cluster.domain_gpus)
    h = np.asarray(home, dtype=np.int64)
    if problem.deepep:
        comp, link, migr, _, _ = full_state_deepep(
            h,
            problem.lq,
            problem.tok,
            problem.w,
            _droutes(problem, cluster),
            cluster.num_domains,
            problem.mig,
        )
    elif problem.integral:
        comp, link, migr = full_state_rail(h, problem.x, problem.w, cluster.domain_gpus, problem.mig)
    else:
        comp, link, migr = full_state(h, problem.x, problem.w, idx, cnt, problem.mig)
    arg = np.zeros((comp.shape[0], 2), dtype=np.int64)
    true, _ = _evaluate(
        comp,
        link,
        migr,
        problem.coef,
        1.0,
        arg,
        problem.compute_group,
        problem.attn,
        problem.overlap_mbs,
        problem.contention,
    )
    return float(true * problem.scale)
