"""The greedy replication's problem and state (numba named tuples) and its objective: ``T_comp`` max plus
``T_comm`` max in token equivalents, or the micro-batch's share of the overlapped layer time under
``cluster.ep_overlap``."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from relibra.cost.overlap import microbatch_share
from relibra.planners.replicate.links import (
    _binds_nvlink,
    _comm_from_totals,
    _comm_lower_bound,
    _comm_per_gpu,
    _deepep_link_totals,
    _node_traffic,
)

_NO_OVERLAP = np.zeros(0)
"""``_Problem.ov`` without ``cluster.ep_overlap``."""
ALL_NODES = -1
"""``node`` argument of :func:`_objective`: rebuild the whole traffic matrix."""
NO_NODE = -2
"""``node`` argument of :func:`_objective`: the traffic matrix already matches ``a``."""


class _Problem(NamedTuple):
    """One (micro-batch, layer) problem and the greedy's constants; read-only in the kernels."""

    x: np.ndarray
    """float64 [G, E]: tokens of source GPU ``j`` for expert ``e``."""
    tot: np.ndarray
    """float64 [E]: ``sum_j x[j, e]``."""
    home: np.ndarray
    """int64 [E]: home GPU of each expert."""
    hnode: np.ndarray
    """int64 [E]: node of each expert's home."""
    gpn: int
    r: int
    fixed: float
    """Token equivalents charged per expert copy (the grouped GEMM's small-count loss)."""
    nvl: float
    """Token equivalents per token on one NVLink direction in one combine phase."""
    nic: float
    """The same on one rail NIC direction."""
    sweeps: int
    max_tries: int
    rel_tol: float
    deepep: bool = False
    """Price communication with the ``deepep`` estimate instead of ``alltoall`` rows."""
    lq: np.ndarray = np.zeros((0, 0))
    """float64 [G, E]: ``log(1 - x[j, e] / T_j)`` (deepep; unused otherwise)."""
    tok: np.ndarray = np.zeros(0)
    """float64 [G]: tokens per source GPU (deepep)."""
    ov: np.ndarray = np.zeros(0)
    """float64 [7] under ``cluster.ep_overlap`` (empty: the objective is ``T_MoE``), token equivalents: the
    micro-batch's attention, the all-to-all latency, then ``(compute, comm)`` of the previous and of the
    next micro-batch (compute negative where there is none), then the all-to-all's SM share (a fraction);
    see :func:`_combine`."""
    dsc: float = 1.0
    """A dispatch phase's coefficients over a combine phase's (its bytes per token over bf16's)."""


class _State(NamedTuple):
    """The greedy's mutable state; the kernels change its arrays in place."""

    a: np.ndarray
    """float64 [E, gpn]: tokens of ``e`` computed on GPU ``k`` of its home node."""
    has: np.ndarray
    """bool [E, gpn]: copies of ``e`` (home or replica slot)."""
    ncopy: np.ndarray
    """int64 [E]: copies of ``e``."""
    pinned: np.ndarray
    """bool [E]: ``e``'s tokens are held by one copy and kept out of the water-filling."""
    comp: np.ndarray
    """float64 [G]: linearised compute per GPU (token equivalents)."""
    slots: np.ndarray
    """int64 [G, r]: expert in each replica slot, -1 if free (filled from the front)."""
    nslot: np.ndarray
    """int64 [G]: filled slots per GPU."""
    traffic: np.ndarray
    """float64 [G, G]: dispatch tokens ``j -> g`` (kept in step with ``a`` where the caller says so); for
    ``deepep`` the same matrix built from ``lq``: the log-miss sums of :func:`_deepep_link_totals`."""
    comm: np.ndarray
    """float64 [G]: linearised ``T_comm(g)`` of the last full evaluation."""


@njit(cache=True)
def _problem(
    x, home, gpn, r, fixed, nvl, nic, sweeps, max_tries, rel_tol, top_k=0, ov=_NO_OVERLAP, dsc=1.0
):  # pragma: no cover
    """``top_k > 0``: the ``deepep`` estimate with ``T_j = sum_e x[j, e] / top_k``; 0: ``alltoall``.
    ``ov``: :attr:`_Problem.ov`; ``dsc``: :attr:`_Problem.dsc`."""
    g_n, e_n = x.shape
    tot = np.zeros(e_n)
    tok = np.zeros(g_n)
    for j in range(g_n):
        for e in range(e_n):
            tot[e] += x[j, e]
            tok[j] += x[j, e]
    lq = x
    if top_k > 0:
        tok /= top_k
        lq = np.zeros((g_n, e_n))
        for j in range(g_n):
            if tok[j] > 0.0:
                for e in range(e_n):
                    lq[j, e] = math.log1p(-min(x[j, e] / tok[j], 1.0 - 1e-12))
    return _Problem(
        x,
        tot,
        home,
        home // gpn,
        gpn,
        r,
        fixed,
        nvl,
        nic,
        sweeps,
        max_tries,
        rel_tol,
        top_k > 0,
        lq,
        tok,
        ov,
        dsc,
    )


@njit(cache=True)
def _home_state(p):  # pragma: no cover - compiled
    """Every expert at home with all its tokens, no replica; traffic and comm zero (not yet built)."""
    g_n, e_n = p.x.shape
    a = np.zeros((e_n, p.gpn))
    has = np.zeros((e_n, p.gpn), np.bool_)
    comp = np.zeros(g_n)
    for e in range(e_n):
        k = p.home[e] % p.gpn
        a[e, k] = p.tot[e]
        has[e, k] = True
        comp[p.home[e]] += p.tot[e] + p.fixed
    return _State(
        a, has, np.ones(e_n, np.int64), np.zeros(e_n, np.bool_), comp, -np.ones((g_n, p.r), np.int64),
        np.zeros(g_n, np.int64), np.zeros((g_n, g_n)), np.zeros(g_n),
    )  # fmt: skip


@njit(cache=True)
def _copy_state(s):  # pragma: no cover - compiled
    return _State(
        s.a.copy(), s.has.copy(), s.ncopy.copy(), s.pinned.copy(), s.comp.copy(), s.slots.copy(),
        s.nslot.copy(), s.traffic.copy(), s.comm.copy(),
    )  # fmt: skip


@njit(cache=True)
def _restore(s, saved):  # pragma: no cover - compiled
    """Copy ``saved`` into ``s`` in place."""
    s.a[:, :] = saved.a
    s.has[:, :] = saved.has
    s.ncopy[:] = saved.ncopy
    s.pinned[:] = saved.pinned
    s.comp[:] = saved.comp
    s.slots[:, :] = saved.slots
    s.nslot[:] = saved.nslot
    s.traffic[:, :] = saved.traffic
    s.comm[:] = saved.comm


@njit(cache=True, inline="always")
def _sync_node(p, s, node):  # pragma: no cover - compiled
    """Rebuild ``node``'s traffic columns from the split (:func:`_node_traffic`)."""
    _node_traffic(p.lq if p.deepep else p.x, p.tot, p.hnode, s.a, s.has, p.gpn, node, s.traffic)


@njit(cache=True)
def _nvlink_bound(p):  # pragma: no cover - compiled
    """Whether the busiest GPU of the home-only plan is bound by NVLink rather than its NIC (in either
    exchange): the case where keeping a heavy sender's tokens local pays, so ``best`` runs the
    communication-first greedy (:func:`_greedy_batch`)."""
    s = _home_state(p)
    for n in range(p.x.shape[0] // p.gpn):
        _sync_node(p, s, n)
    _comm_into(p, s)
    return _binds_nvlink(p, s, np.argmax(s.comm))


@njit(cache=True, inline="always")
def _combine(p, t_comp, t_comm):  # pragma: no cover - compiled
    """The objective from the compute and communication maxima (token equivalents): ``t_comp + t_comm``,
    or under ``cluster.ep_overlap`` (``p.ov``) the terms of the overlapped layer time this micro-batch
    enters with its neighbours fixed (:func:`relibra.cost.overlap.microbatch_share`, attention and latency
    added). Non-decreasing in both, so a lower bound on ``t_comm`` bounds it."""
    if p.ov.size == 0:
        return t_comp + t_comm
    return microbatch_share(t_comp + p.ov[0], t_comm + p.ov[1], p.ov[2:6], math.inf, p.ov[6])


@njit(cache=True, inline="always")
def _objective(p, s, use_comm, node, thr):  # pragma: no cover - compiled
    """Linearised ``max_g comp + max_g comm`` (token equivalents, without the latency constant), or its
    overlapped form (:func:`_combine`).

    ``thr``: the caller only needs to know whether the objective is under ``thr``. When a lower bound on
    the busiest GPU of the last full evaluation (``argmax comm``) already reaches it, that bound is
    returned instead and ``comm`` is left as it was: a rejected candidate costs O(G), not O(G^2).

    The traffic [G, G] is kept in step with ``a`` incrementally: a candidate copy changes the split of
    one node's experts only, so only that node's ``gpn`` columns are rebuilt (``node >= 0``);
    :data:`ALL_NODES` rebuilds all, :data:`NO_NODE` none. Unused (left as is) when ``use_comm`` is False.
    """
    t_comp = s.comp.max()
    if not use_comm:
        return t_comp
    if node == ALL_NODES:
        for n in range(p.x.shape[0] // p.gpn):
            _sync_node(p, s, n)
    elif node >= 0:
        _sync_node(p, s, node)
    if thr < np.inf and not p.deepep:  # NOTE: the O(G) bound is alltoall's; deepep evaluates in full
        bound = _combine(
            p, t_comp, _comm_lower_bound(s.traffic, p.gpn, p.nvl, p.nic, np.argmax(s.comm), p.dsc)
        )
        if bound >= thr:
            return bound
    _comm_into(p, s)
    return _combine(p, t_comp, s.comm.max())


@njit(cache=True, inline="always")
def _comm_into(p, s):  # pragma: no cover - compiled
    """``s.comm`` from ``s.traffic`` by the problem's dispatcher."""
    if p.deepep:
        _comm_from_totals(_deepep_link_totals(s.traffic, p.tok, p.gpn), p.nvl, p.nic, s.comm, p.dsc)
    else:
        _comm_per_gpu(s.traffic, p.gpn, p.nvl, p.nic, s.comm, p.dsc)
