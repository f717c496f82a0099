"""The greedy replication's search loop (numba): one problem's greedy over its steps, the polish by
exchange moves, and the batch of problems one call solves."""

from __future__ import annotations

import numpy as np
from numba import njit

from relibra.planners.replicate.moves import (
    _comm_step,
    _compute_step,
    _resplit,
    _round_split,
    _take_slot,
    _try_copy,
    _undo_copy,
    _waterfill,
)
from relibra.planners.replicate.state import (
    _NO_OVERLAP,
    ALL_NODES,
    NO_NODE,
    _copy_state,
    _home_state,
    _nvlink_bound,
    _objective,
    _problem,
    _restore,
    _sync_node,
)


@njit(cache=True)
def _greedy_one(p, accept_comm, track_comm, comm_first):  # pragma: no cover - compiled
    """Greedy replication of one problem.

    ``accept_comm``: a copy is kept if compute max plus comm max drops (else if the compute max drops), and
    when no compute-driven copy helps, a communication-driven one is tried (see below).
    ``track_comm``: return the state, along the greedy's path, with the lowest compute-plus-comm objective.
    ``comm_first``: try the communication-driven move before the compute-driven one (needs accept_comm).
    Returns (the kept state, its objective in token equivalents without latency).
    """
    g_n, e_n = p.x.shape
    s = _home_state(p)
    obj = _objective(p, s, accept_comm, ALL_NODES, np.inf)
    best = _objective(p, s, True, ALL_NODES, np.inf)
    kept = _copy_state(s) if track_comm else s  # the best state so far (only tracked when asked)
    a_sync = s.a.copy()  # the split that ``traffic`` was last built from (track_comm without accept_comm)
    while True:
        new = _comm_step(p, s, obj) if comm_first else -1.0
        if new < 0.0:
            new = _compute_step(p, s, accept_comm, obj, -1)
        if new < 0.0 and accept_comm and not comm_first:
            new = _comm_step(p, s, obj)
        if new < 0.0:
            break
        obj = new
        if track_comm:
            if accept_comm:
                full = obj
            else:
                # A step re-splits one node's experts: rebuild the traffic columns of the nodes whose split
                # changed, and let a lower bound reject a state that cannot beat the best one.
                changed = np.zeros(g_n // p.gpn, np.bool_)
                for e in range(e_n):
                    for k in range(p.gpn):
                        if s.a[e, k] != a_sync[e, k]:
                            changed[p.hnode[e]] = True
                for n in range(g_n // p.gpn):
                    if changed[n]:
                        _sync_node(p, s, n)
                a_sync[:, :] = s.a
                full = _objective(p, s, True, NO_NODE, best * (1.0 - p.rel_tol))
            if full < best * (1.0 - p.rel_tol):
                best = full
                _restore(kept, s)
    if track_comm:
        return kept, best
    return s, _objective(p, s, True, ALL_NODES, np.inf)


@njit(cache=True)
def _remove_copy(p, s, e, g):  # pragma: no cover - compiled
    """Drop the copy of ``e`` on ``g`` (not its home): ``e``'s tokens go back home and are water-filled over
    the copies left, then the node's other replicated, unpinned experts are re-split; the slot is freed."""
    base = (g // p.gpn) * p.gpn
    for k in range(p.gpn):
        s.comp[base + k] -= s.a[e, k]
        s.a[e, k] = 0.0
    s.has[e, g - base] = False
    s.comp[g] -= p.fixed
    s.ncopy[e] -= 1
    s.pinned[e] = False
    kh = p.home[e] - base
    s.a[e, kh] = p.tot[e]
    s.comp[p.home[e]] += p.tot[e]
    if s.ncopy[e] > 1:
        _waterfill(e, p.tot[e], base, s.a, s.has, s.comp, p.gpn)
    _resplit(p, s, g // p.gpn)
    n = 0
    for i in range(s.nslot[g]):
        if s.slots[g, i] != e:
            s.slots[g, n] = s.slots[g, i]
            n += 1
    for i in range(n, s.slots.shape[1]):
        s.slots[g, i] = -1
    s.nslot[g] = n


@njit(cache=True)
def _ranked(key, mask, k):  # pragma: no cover - compiled
    """Indices of the ``k`` largest ``key`` where ``mask`` holds, largest first (fewer if fewer hold)."""
    idx = np.flatnonzero(mask)
    order = np.argsort(-key[idx], kind="mergesort")
    return idx[order[: min(k, idx.size)]]


@njit(cache=True)
def _add_kept(p, s, e, t, pin_first, thr, a1, comp1):  # pragma: no cover - compiled
    """Try a copy of ``e`` on ``t``, pinned and water-filled (``pin_first`` first); keep the first that brings
    the objective under ``thr`` and return it, else restore the state (``a1``, ``comp1``) and return -1.0."""
    for i in range(2):
        pin = pin_first if i == 0 else not pin_first
        p_old = s.pinned[e]
        v = _try_copy(p, s, e, t, pin, True, thr)
        if v < thr:
            _take_slot(s, t, e)
            return v
        _undo_copy(p, s, e, t, p_old, a1, comp1)
        _sync_node(p, s, t // p.gpn)
    return -1.0


@njit(cache=True)
def _exchange(p, s, ratio, e, g, thr, cands):  # pragma: no cover - compiled
    """One exchange move of :func:`_polish`: drop the copy of ``e`` on ``g``, then add the first copy that
    brings the objective under ``thr`` (or none, if dropping alone does). Returns the new objective, or -1.0
    with the state unchanged."""
    node = g // p.gpn
    base = node * p.gpn
    saved = _copy_state(s)
    _remove_copy(p, s, e, g)
    new = _objective(p, s, True, node, np.inf)
    if new < thr:
        return new
    gc = np.argmax(s.comm)
    gb = np.argmax(s.comp)
    a1, comp1 = s.a.copy(), s.comp.copy()
    adds = []  # (expert, target, pinned first), in the order of the three rules
    for t in (gc, g):  # keep a sender's tokens local: on gc, or on the freed g
        if t // p.gpn == node and s.nslot[t] < p.r:
            mask = (p.hnode == node) & ~s.has[:, t - base] & (p.x[t] > 0.0)
            for e2 in _ranked(p.x[t] * ratio, mask, cands):
                adds.append((e2, t, True))
    if gb // p.gpn == node:  # relieve the compute bottleneck
        kb = gb - base
        mask = (p.hnode == node) & s.has[:, kb] & (s.a[:, kb] > 0.0) & (s.ncopy < p.gpn)
        for e2 in _ranked(s.a[:, kb], mask, cands):
            for t in range(base, base + p.gpn):
                adds.append((e2, t, False))
    for e2, t, pin_first in adds:
        if (e2 == e and t == g) or s.has[e2, t - base] or s.nslot[t] >= p.r:
            continue
        new = _add_kept(p, s, e2, t, pin_first, thr, a1, comp1)
        if new >= 0.0:
            return new
    _restore(s, saved)
    _sync_node(p, s, node)
    return -1.0


@njit(cache=True)
def _polish(p, s, moves, cands):  # pragma: no cover - compiled
    """Exchange local search on a finished greedy state, in place; returns the objective.

    A move drops one copy and either stops there or adds one copy in the same node: on the GPU with the
    busiest links (an expert it sends many of its tokens for, by ``x[gc, e] / (tokens + fixed)``), on the
    GPU whose slot was freed (the same rule), or off the compute bottleneck (its heaviest experts onto the
    node's GPUs with a free slot), each water-filled or holding all of the expert's tokens. The first move
    that lowers the objective is kept (at most ``moves`` of them); ``cands`` experts are tried per rule.
    """
    g_n, e_n = p.x.shape
    s.comp[:] = 0.0  # from the split itself, free of the greedy's incremental drift
    for e in range(e_n):
        for k in range(p.gpn):
            if s.has[e, k]:
                s.comp[p.hnode[e] * p.gpn + k] += s.a[e, k] + p.fixed
    obj = _objective(p, s, True, ALL_NODES, np.inf)
    ratio = 1.0 / (p.tot + p.fixed)
    for _ in range(moves):
        new = -1.0
        for g in range(g_n):
            for i in range(s.nslot[g]):
                new = _exchange(p, s, ratio, s.slots[g, i], g, obj * (1.0 - p.rel_tol), cands)
                if new >= 0.0:
                    break
            if new >= 0.0:
                break
        if new < 0.0:
            break
        obj = new
    return _objective(p, s, True, ALL_NODES, np.inf)


@njit(cache=True)
def _greedy_batch(
    x,
    home,
    gpn,
    r,
    fixed,
    nvl,
    nic,
    mode,
    sweeps,
    max_tries,
    rel_tol,
    polish_moves,
    polish_cands,
    top_k,
    ov,
    dsc=1.0,
):  # pragma: no cover
    """x [P, G, E] float64, home [P, E] -> assign int64 [P, E, G], replicas int64 [P, G, r].

    ``ov`` [P, 7] (:attr:`_Problem.ov` of each problem) under ``cluster.ep_overlap``, else [0, 7].

    ``mode``: 0 compute-only acceptance; 1 compute-plus-comm acceptance; 2 three runs, the best kept
    (mode 1, mode 1 with the communication-driven move tried first, and the compute-driven run returning its
    best state along the way). ``polish_moves > 0``: then :func:`_polish` on the kept state.
    """
    p_n, g_n, e_n = x.shape
    assign = np.zeros((p_n, e_n, g_n), np.int64)
    replicas = -np.ones((p_n, g_n, r), np.int64)
    for q in range(p_n):
        ov_q = ov[q] if ov.shape[0] > 0 else _NO_OVERLAP
        p = _problem(x[q], home[q], gpn, r, fixed, nvl, nic, sweeps, max_tries, rel_tol, top_k, ov_q, dsc)
        s, obj = _greedy_one(p, mode >= 1, False, False)
        if mode == 2:
            # comm-first (only where NVLink binds: keeping a sender's tokens local saves no NIC time);
            # compute-driven, its path cut at its best T_MoE
            first = 0 if _nvlink_bound(p) else 1
            for variant in range(first, 2):
                s2, obj2 = _greedy_one(p, variant == 0, variant == 1, variant == 0)
                if obj2 < obj:
                    s, obj = s2, obj2
        if polish_moves > 0:
            _polish(p, s, polish_moves, polish_cands)
        tot_int = np.zeros(e_n, np.int64)
        for j in range(g_n):
            for e in range(e_n):
                tot_int[e] += np.int64(x[q, j, e])
        ai = _round_split(s.a, s.has, tot_int)
        for e in range(e_n):
            base = (home[q, e] // gpn) * gpn
            for k in range(gpn):
                assign[q, e, base + k] = ai[e, k]
        for g in range(g_n):
            n = 0
            for i in range(r):
                e = s.slots[g, i]
                if e >= 0 and assign[q, e, g] > 0:
                    replicas[q, g, n] = e
                    n += 1
    return assign, replicas
