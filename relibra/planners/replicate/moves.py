"""The greedy replication's moves (numba): where the next copy goes, the water-filling split and its
rounding, trying and undoing a copy, and the three steps (compute, communication send side, receive
side) of :func:`relibra.planners.replicate.greedy.replicate_greedy`."""

from __future__ import annotations

import numpy as np
from numba import njit

from relibra.planners.replicate.links import _binds_nvlink
from relibra.planners.replicate.state import NO_NODE, _copy_state, _objective, _restore, _sync_node


@njit(cache=True)
def _next_copy(e, base_gpu, a, has, comp, gpn, pv, pk):  # pragma: no cover - compiled
    """The copy ``k`` of ``e`` next after ``(pv, pk)`` by (level without ``e``, ``k``); (inf, -1) if none."""
    best_v = np.inf
    best_k = -1
    for k in range(gpn):
        if has[e, k]:
            v = comp[base_gpu + k] - a[e, k]
            if (v > pv or (v == pv and k > pk)) and (best_k < 0 or v < best_v):
                best_v = v
                best_k = k
    return best_v, best_k


@njit(cache=True)
def _waterfill(e, tot_e, base_gpu, a, has, comp, gpn):  # pragma: no cover - compiled
    """Closed-form split of expert ``e``'s ``tot_e`` tokens over its copies (min of the max copy load).

    The copies are walked by increasing level without an array or a sort (an expert has at most ``gpn``
    copies), so that this allocation-free inner step stays cheap; ties take the lower ``k``, and the level
    does not depend on how ties are ordered.
    """
    m = 0
    for k in range(gpn):
        if has[e, k]:
            m += 1
    pv = -np.inf
    pk = -1
    level = 0.0
    prefix = 0.0
    for i in range(m):
        v, k = _next_copy(e, base_gpu, a, has, comp, gpn, pv, pk)
        prefix += v
        level = (tot_e + prefix) / (i + 1)
        if i + 1 == m or level <= _next_copy(e, base_gpu, a, has, comp, gpn, v, k)[0]:
            break
        pv = v
        pk = k
    for k in range(gpn):  # copy k's level reads only comp[base_gpu + k], not yet changed here
        if has[e, k]:
            lv = comp[base_gpu + k] - a[e, k]
            new = level - lv if level > lv else 0.0
            comp[base_gpu + k] += new - a[e, k]
            a[e, k] = new


@njit(cache=True)
def _round_split(a, has, tot_int):  # pragma: no cover - compiled
    """Largest-remainder rounding per expert: a [E, gpn] float -> int64 [E, gpn] with exact row sums."""
    e_n, gpn = a.shape
    out = np.zeros((e_n, gpn), np.int64)
    for e in range(e_n):
        s = 0
        frac = np.empty(gpn)
        for k in range(gpn):
            f = np.floor(a[e, k]) if has[e, k] else 0.0
            out[e, k] = np.int64(f)
            frac[k] = a[e, k] - f if has[e, k] else -1.0
            s += out[e, k]
        rest = tot_int[e] - s
        order = np.argsort(-frac)
        i = 0
        while rest > 0:
            out[e, order[i % gpn]] += 1
            rest -= 1
            i += 1
        while rest < 0:  # NOTE: only reachable through float drift above the total; take from the largest.
            kmax = np.argmax(out[e])
            out[e, kmax] -= 1
            rest += 1
    return out


LOOKAHEAD = 2
"""Moves out of the busiest-link GPU tried after a communication-driven copy before it is given up."""


@njit(cache=True, inline="always")
def _resplit(p, s, node):  # pragma: no cover - compiled
    """``sweeps`` water-filling sweeps over ``node``'s replicated, unpinned experts."""
    base = node * p.gpn
    # NOTE: arrays bound to locals once: reading one from a tuple inside the loop costs a reference count
    a, has, comp, ncopy, pinned, hnode, tot = s.a, s.has, s.comp, s.ncopy, s.pinned, p.hnode, p.tot
    for _ in range(p.sweeps):
        for f in range(a.shape[0]):
            if ncopy[f] > 1 and not pinned[f] and hnode[f] == node:
                _waterfill(f, tot[f], base, a, has, comp, p.gpn)


@njit(cache=True, inline="always")
def _try_copy(p, s, e, target, pin, use_comm, thr):  # pragma: no cover - compiled
    """Add a copy of ``e`` on ``target`` (same node) and return the objective.

    ``pin=False``: water-fill ``e`` over its copies; ``pin=True``: move all of ``e``'s tokens to the new copy
    (the move that keeps a heavy sender's tokens local) and keep them there. Then the node's other
    replicated, unpinned experts are re-split. The caller saves ``a``, ``comp`` and ``pinned[e]`` first.
    ``thr``: see :func:`_objective` (``np.inf`` for the exact objective). The slot is not recorded.
    """
    base_gpu = (target // p.gpn) * p.gpn
    kt = target - base_gpu
    s.has[e, kt] = True
    s.comp[target] += p.fixed
    s.ncopy[e] += 1
    s.pinned[e] = pin
    if pin:
        for k in range(p.gpn):
            s.comp[base_gpu + k] -= s.a[e, k]
            s.a[e, k] = 0.0
        s.a[e, kt] = p.tot[e]
        s.comp[target] += p.tot[e]
    else:
        _waterfill(e, p.tot[e], base_gpu, s.a, s.has, s.comp, p.gpn)
    node = target // p.gpn
    _resplit(p, s, node)
    return _objective(p, s, use_comm, node, thr)


@njit(cache=True, inline="always")
def _undo_copy(p, s, e, target, pinned_old, a_old, comp_old):  # pragma: no cover - compiled
    s.a[:, :] = a_old
    s.comp[:] = comp_old
    s.has[e, target % p.gpn] = False
    s.ncopy[e] -= 1
    s.pinned[e] = pinned_old


@njit(cache=True, inline="always")
def _take_slot(s, g, e):  # pragma: no cover - compiled
    s.slots[g, s.nslot[g]] = e
    s.nslot[g] += 1


@njit(cache=True, inline="always")
def _free_target(p, s, e, base, key):  # pragma: no cover - compiled
    """The GPU of the node at ``base`` with a free slot and no copy of ``e`` that has the lowest ``key``
    [G] (ties: the first); -1 if none."""
    target = -1
    has, nslot = s.has, s.nslot
    for k in range(p.gpn):
        g = base + k
        if not has[e, k] and nslot[g] < p.r and (target < 0 or key[g] < key[target]):
            target = g
    return target


@njit(cache=True)
def _compute_step(p, s, use_comm, obj_ref, source):  # pragma: no cover - compiled
    """One step of the paper's greedy: the bottleneck GPU's heaviest experts, each onto the least-loaded GPU
    of the node with a free slot; the first copy that brings the objective under ``obj_ref`` is kept.

    ``source >= 0`` relieves that GPU instead, moving out whole first the experts it sends the fewest of its
    own tokens to, and keeps the first copy that is possible (``obj_ref`` ignored): a lookahead move.
    Returns the new objective, or -1.0 when no copy helped (the state is then unchanged).
    """
    e_n = p.x.shape[1]
    gstar = np.argmax(s.comp) if source < 0 else source
    base_gpu = (gstar // p.gpn) * p.gpn
    node = gstar // p.gpn
    kstar = gstar % p.gpn
    cand = np.empty(e_n, np.int64)
    weight = np.empty(e_n)
    nc = 0
    a, has, ncopy, hnode, x = s.a, s.has, s.ncopy, p.hnode, p.x
    for e in range(e_n):
        if hnode[e] == node and has[e, kstar] and a[e, kstar] > 0.0 and ncopy[e] < p.gpn:
            cand[nc] = e
            weight[nc] = -a[e, kstar] if source < 0 else x[gstar, e] / a[e, kstar]
            nc += 1
    order = np.argsort(weight[:nc])
    a_old = s.a.copy()
    comp_old = s.comp.copy()
    thr = obj_ref * (1.0 - p.rel_tol)
    for t in range(min(nc, p.max_tries)):
        e = cand[order[t]]
        target = _free_target(p, s, e, base_gpu, s.comp)
        if target < 0:
            continue
        pin_old = s.pinned[e]
        for pin in (False, True):  # water-filled, or (for T_MoE) moved out whole: frees a heavy sender
            if pin and not use_comm:
                break
            # a lookahead move (source >= 0, pin) is kept even when not under thr, but its caller then
            # compares it with the same thr: a lower bound at or over thr decides it as the exact value does
            new = _try_copy(p, s, e, target, pin, use_comm, thr)
            if new < thr or (source >= 0 and pin):
                _take_slot(s, target, e)
                return new
            _undo_copy(p, s, e, target, pin_old, a_old, comp_old)
            if use_comm:  # the trial's columns back in step with the restored split
                _sync_node(p, s, node)
    return -1.0


@njit(cache=True)
def _comm_step(p, s, obj):  # pragma: no cover - compiled
    """Communication-driven step; returns the new objective, or -1.0 with the state unchanged."""
    e_n = p.x.shape[1]
    cand = np.empty(e_n, np.int64)
    weight = np.empty(e_n)
    new = -1.0
    thr = obj * (1.0 - p.rel_tol)
    # Communication-driven move: a copy on the GPU with the busiest links, of an expert it sends many
    # tokens for, either water-filled or holding all of that expert's tokens (kept local: the send
    # side that compute balancing cannot reach). It often pays only together with the compute step
    # that relieves that GPU next, so that step is tried as a one-move lookahead. Keeping tokens local
    # saves NVLink time only, so this side is tried only where NVLink binds that GPU.
    _objective(p, s, True, NO_NODE, np.inf)
    gc = np.argmax(s.comm)
    node = gc // p.gpn
    kc = gc % p.gpn
    nc = 0
    if s.nslot[gc] < p.r and _binds_nvlink(p, s, gc):
        has, hnode, x, tot = s.has, p.hnode, p.x, p.tot
        for e in range(e_n):
            if hnode[e] == node and not has[e, kc] and x[gc, e] > 0.0:
                cand[nc] = e
                # tokens gc stops sending per token equivalent of compute it takes on: a whole (pinned)
                # copy of an expert whose demand is mostly gc's own pays most
                weight[nc] = -x[gc, e] / (tot[e] + p.fixed)
                nc += 1
    order = np.argsort(weight[:nc])
    saved = _copy_state(s) if nc > 0 else s  # nothing to restore when there is no candidate
    for t in range(min(nc, p.max_tries)):
        e = cand[order[t]]
        # pinned first: a water-filled copy on a loaded gc takes few tokens, saves little, yet holds the slot
        for pin in (True, False):
            trial = _try_copy(p, s, e, gc, pin, True, thr)
            _take_slot(s, gc, e)
            if trial < thr:
                new = trial
                break
            trial = _compute_step(p, s, True, obj, -1)
            if trial >= 0.0:
                new = trial
                break
            for _ in range(LOOKAHEAD):  # relieve gc: move out whole the experts it holds mostly for others
                trial = _compute_step(p, s, True, obj, gc)
                if trial < thr:
                    break
            if 0.0 <= trial < thr:
                new = trial
                break
            _restore(s, saved)
        if new >= 0.0:
            break
    if new < 0.0:  # the receive side of the same GPU
        new = _receive_step(p, s, obj, gc)
    return new


@njit(cache=True)
def _receive_step(p, s, obj, gc):  # pragma: no cover - compiled
    """Receive-side communication move: spread the experts that the busiest-link GPU ``gc`` computes for
    other GPUs' tokens over a second copy in its node (water-filled, or holding all of the expert's
    tokens), on the GPU with the least busy links among those with a free slot. Under the proportional
    split, every source then sends that copy its share, so ``gc`` receives (and returns) fewer tokens.
    ``comm`` must be that of the current state (the caller's last full evaluation). Returns the new
    objective, or -1.0 with the state unchanged."""
    e_n = p.x.shape[1]
    node = gc // p.gpn
    base = node * p.gpn
    kc = gc - base
    cand = np.empty(e_n, np.int64)
    weight = np.empty(e_n)
    nc = 0
    a, has, ncopy, pinned, hnode, x, tot = s.a, s.has, s.ncopy, s.pinned, p.hnode, p.x, p.tot
    for e in range(e_n):
        if hnode[e] == node and has[e, kc] and a[e, kc] > 0.0 and ncopy[e] < p.gpn and not pinned[e]:
            cand[nc] = e
            weight[nc] = -a[e, kc] / tot[e] * (tot[e] - x[gc, e])  # remote tokens gc receives for e
            nc += 1
    order = np.argsort(weight[:nc])
    a_old = s.a.copy()
    comp_old = s.comp.copy()
    thr = obj * (1.0 - p.rel_tol)
    for t in range(min(nc, p.max_tries)):
        e = cand[order[t]]
        target = _free_target(p, s, e, base, s.comm)
        if target < 0:
            continue
        for pin in (False, True):  # a second copy water-filled, or the expert moved there whole
            new = _try_copy(p, s, e, target, pin, True, thr)
            if new < thr:
                _take_slot(s, target, e)
                return new
            _undo_copy(p, s, e, target, False, a_old, comp_old)
            _sync_node(p, s, node)
    return -1.0
