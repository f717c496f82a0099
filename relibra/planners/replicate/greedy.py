"""ReLibra's intra-batch replication: incremental greedy replica placement with a water-filling token split.

One problem is one (micro-batch, layer): loads ``x[j, e]`` (source GPU ``j``, expert ``e``) and the
placement ``home[e]`` are fixed; each GPU has ``r`` replica slots (the layer-shared buffer) that may hold
copies of experts whose home is on the **same node**. The greedy (paper, "intra-batch replication"):

1. compute step: find the bottleneck GPU (largest linearised compute); take its experts by decreasing
   tokens; for the first one whose copy helps, add a copy on the least-loaded GPU of the node that has a
   free slot and no copy of it yet; re-solve the token split;
2. communication step (``acceptance`` ``"comm"`` / ``"best"``, when no compute step helps), at the GPU with
   the busiest links: where NVLink binds it, a copy on it of an expert whose demand is mostly its own
   (by ``x[gc, e] / (tokens + fixed)``), holding all of that expert's tokens or else water-filled, with up
   to :data:`LOOKAHEAD` follow-up moves that relieve that GPU (the send side); failing that, a second
   copy, water-filled or holding all tokens, of
   an expert that GPU receives many remote tokens for, on the node's GPU with the least busy links (the
   receive side);
3. keep a move only if the objective drops: the compute max (``"compute"``) or the linearised
   ``T_comp_max + T_comm_max`` (``"comm"``; :meth:`relibra.cost.model.CostModel.linear`); ``"best"`` runs
   ``"comm"``, ``"comm"`` with the communication step first (where NVLink binds the busiest GPU), and
   ``"compute"`` cut where its ``T_MoE`` was lowest, and keeps the lowest ``T_MoE``;
4. stop when no move improves the objective or no slot is left (under ``cluster.ep_overlap`` the
   objective is the micro-batch's share of the overlapped layer time given its neighbours,
   :func:`relibra.cost.overlap.microbatch_share`; see :mod:`relibra.planners.refill` and docs/replicate.md);
5. optionally (``polish_moves > 0``) polish the result with exchange moves: drop one copy, add another in
   the same node, keep the first exchange that lowers the objective (:func:`_polish`).

The split is solved two ways:

* ``split="waterfill"`` (default): compute-only, in closed form. Given the other loads ``b[g]`` of an
  expert's copies, its ``A`` tokens fill the copies up to one level ``lambda`` with
  ``sum_g max(0, lambda - b[g]) = A``. A few sweeps of this over the node's replicated experts converge to
  the split that minimises the sum of squared GPU loads, which for this splittable restricted-assignment
  problem is also the min-max split (the lexicographically optimal base of a polymatroid, Fujishige).
  Compiled with numba: 0.1-0.7 ms per problem at EP 8-64 (docs/benchmarks.md). A candidate's
  communication term is evaluated incrementally: only the traffic columns of the node whose split changed
  are rebuilt, and a candidate whose compute max plus an O(G) lower bound on one GPU's communication
  already misses the threshold is rejected without the O(G^2) pass (docs/replicate.md).
* ``split="lp"``: the general case. Every candidate's split is the LP of the paper's eq. 7 with the replica
  set fixed (:func:`relibra.planners.replicate.milp.solve_split`), including the communication terms.

Tokens are then rounded to int32 per expert with the largest-remainder rule, so that
``assign[e, :].sum() == sum_j x[j, e]`` exactly; slots whose copy ends with no tokens are emptied.
Work is measured in *token equivalents*: compute seconds divided by ``compute_s_per_token``, so an expert
costs ``tokens + gemm_half_tokens`` on every GPU that holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, get_args

import numpy as np
from numba import njit

from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours, microbatch_share
from relibra.planners.protocols import BatchContext, Replication
from relibra.planners.replicate.terms import ReplicationCoefficients, round_assign

SplitMethod = Literal["waterfill", "lp"]
Acceptance = Literal["best", "comm", "compute"]
_MODES = {"compute": 0, "comm": 1, "best": 2}

__all__ = [
    "Acceptance",
    "GreedyConfig",
    "GreedyReplicator",
    "ReplicationCoefficients",
    "SplitMethod",
    "linear_objective",
    "replicate_greedy",
    "round_assign",
]


# ----------------------------------------------------------------------------------------- compiled core
@njit(cache=True)
def _comm_per_gpu(traffic, gpn, nvl, nic, out):  # pragma: no cover - compiled
    """Linearised ``T_comm(g)`` without latency; traffic [G(j), G(g)] dispatch tokens -> out [G].

    Same routing as :meth:`CostModel.link_bytes`: cross-rail traffic hops over NVLink to the source node's
    GPU on the destination rail, then over that rail's NIC. Combine is the transpose of dispatch.
    Row ``j`` is walked node block by node block (no integer division in the inner loop); every link
    total receives its terms in the order of ``(j, g)``, so the sums are the same floats whatever the
    loop's shape. Zero entries are added too: ``+0.0`` leaves a non-negative sum unchanged.
    """
    g_n = traffic.shape[0]
    acc = np.zeros((8, g_n))  # dispatch nvl send/recv, nic send/recv; then the same for combine
    for j in range(g_n):
        nj = j // gpn
        rj = j - nj * gpn
        own = nj * gpn
        s0, s2, s5, s7 = acc[0, j], acc[2, j], acc[5, j], acc[7, j]  # totals only row j adds to now
        for b in range(0, g_n, gpn):
            if b == own:
                for k in range(gpn):
                    if k == rj:
                        continue
                    g = b + k
                    t = traffic[j, g]
                    s0 += t
                    acc[1, g] += t
                    acc[4, g] += t
                    s5 += t
                continue
            q = b + rj
            for k in range(gpn):
                g = b + k
                t = traffic[j, g]
                if k == rj:
                    s2 += t
                    acc[3, g] += t
                    acc[6, g] += t
                    s7 += t
                else:
                    p = own + k
                    s0 += t
                    acc[1, p] += t
                    acc[2, p] += t
                    acc[3, g] += t
                    acc[4, g] += t
                    acc[5, q] += t
                    acc[6, q] += t
                    s7 += t
        acc[0, j], acc[2, j], acc[5, j], acc[7, j] = s0, s2, s5, s7
    _comm_from_totals(acc, nvl, nic, out)


@njit(cache=True)
def _node_traffic(x, tot, hnode, a, has, gpn, node, traffic):  # pragma: no cover - compiled
    """Rebuild the columns of ``node``'s GPUs in traffic [G(j), G(g)] from the split ``a`` [E, gpn].

    Only experts homed on ``node`` have copies there, and each entry receives its terms by increasing
    expert id from zero, so the block equals the one a rebuild of the whole matrix gives, bit for bit.
    """
    g_n, e_n = x.shape
    base = node * gpn
    traffic[:, base : base + gpn] = 0.0
    for e in range(e_n):
        if tot[e] <= 0.0 or hnode[e] != node:
            continue
        for k in range(gpn):
            if has[e, k] and a[e, k] > 0.0:
                s = a[e, k] / tot[e]
                g = base + k
                for j in range(g_n):
                    traffic[j, g] += x[j, e] * s


@njit(cache=True)
def _gpu_link_totals(traffic, gpn, g):  # pragma: no cover - compiled
    """The eight link totals of GPU ``g`` (tokens; the order of :func:`_comm_per_gpu`'s ``acc``), in O(G).

    Summed from the same terms as :func:`_comm_per_gpu` in another order, so equal up to rounding.
    """
    g_n = traffic.shape[0]
    b = (g // gpn) * gpn
    rg = g - b
    s = np.zeros(8)
    for j in range(g_n):
        in_node = b <= j < b + gpn
        for c in range(0, g_n, gpn):
            if c == b:
                if in_node:  # intra-node: sends and receives of g
                    if j == g:
                        for k in range(gpn):
                            if k != rg:
                                s[0] += traffic[g, c + k]
                                s[5] += traffic[g, c + k]
                    else:
                        s[1] += traffic[j, g]
                        s[4] += traffic[j, g]
                else:  # from another node into g's node
                    s[3] += traffic[j, g]
                    if j % gpn == rg:  # arrives over g's rail: g relays all of it
                        for k in range(gpn):
                            s[6] += traffic[j, c + k]
                            if k != rg:
                                s[5] += traffic[j, c + k]
                    else:
                        s[4] += traffic[j, g]
            elif in_node:  # from g's node to another node: rail rg leaves through g
                t = traffic[j, c + rg]
                s[2] += t
                if j == g:
                    for k in range(gpn):
                        s[7] += traffic[g, c + k]
                        if k != rg:
                            s[0] += traffic[g, c + k]
                else:
                    s[1] += t
    return s


@njit(cache=True)
def _comm_lower_bound(traffic, gpn, nvl, nic, g):  # pragma: no cover - compiled
    """A lower bound on what :func:`_comm_per_gpu` gives for GPU ``g`` alone, in O(G).

    :func:`_gpu_link_totals` shrunk by :data:`BOUND_SLACK`, far more than the rounding of either summation
    order (n terms: n * 1.1e-16 relative).
    """
    s = _gpu_link_totals(traffic, gpn, g) * (1.0 - BOUND_SLACK)
    d = max(max(s[0], s[1]) * nvl, max(s[2], s[3]) * nic)
    c2 = max(max(s[4], s[5]) * nvl, max(s[6], s[7]) * nic)
    return 2.0 * (d + c2)


@njit(cache=True)
def _nvlink_binds(traffic, gpn, nvl, nic, g):  # pragma: no cover - compiled
    """Whether NVLink, not the NIC, binds GPU ``g`` in the dispatch or the combine exchange."""
    return _binds_in(_gpu_link_totals(traffic, gpn, g), nvl, nic)


@njit(cache=True)
def _binds_in(s, nvl, nic):  # pragma: no cover - compiled
    """Whether NVLink binds in either exchange, from one GPU's eight link totals ``s`` [8]."""
    return max(s[0], s[1]) * nvl >= max(s[2], s[3]) * nic or max(s[4], s[5]) * nvl >= max(s[6], s[7]) * nic


@njit(cache=True)
def _deepep_link_totals(miss_log, tok, gpn):  # pragma: no cover - compiled
    """The eight link totals [8, G] of every GPU under the ``deepep`` estimate (order of ``acc`` above).

    ``miss_log`` [G(j), G(g)]: ``sum_e log(1 - x[j, e] / T_j) * share[e, g]`` (built like the traffic
    matrix, from ``log(1 - q)`` in place of ``x``); tok [G]: tokens per source. A token of ``j`` reaches
    GPU ``g`` with ``tok[j] * (1 - exp(miss_log[j, g]))`` tokens, a node with one minus the product of its
    GPUs' miss probabilities (:func:`relibra.cost.fabric.deepep_link_tokens_estimate`).
    """
    g_n = miss_log.shape[0]
    acc = np.zeros((8, g_n))
    for j in range(g_n):
        t = tok[j]
        if t <= 0.0:
            continue
        nj = j // gpn
        rj = j - nj * gpn
        for b in range(0, g_n, gpn):
            miss_node = 1.0
            sender = j if b == nj * gpn else b + rj  # the GPU that fans the token out in node b
            for k in range(gpn):
                g = b + k
                m = math.exp(miss_log[j, g])
                miss_node *= m
                if g != sender:
                    hit = t * (1.0 - m)
                    acc[0, sender] += hit
                    acc[1, g] += hit
                    acc[4, g] += hit
                    acc[5, sender] += hit
            if b != nj * gpn:
                hit = t * (1.0 - miss_node)
                acc[2, j] += hit
                acc[3, sender] += hit
                acc[6, sender] += hit
                acc[7, j] += hit
    return acc


@njit(cache=True)
def _comm_from_totals(acc, nvl, nic, out):  # pragma: no cover - compiled
    """Linearised ``T_comm(g)`` [G] from the eight link totals [8, G] (busiest direction per phase)."""
    for g in range(acc.shape[1]):
        d = max(max(acc[0, g], acc[1, g]) * nvl, max(acc[2, g], acc[3, g]) * nic)
        c = max(max(acc[4, g], acc[5, g]) * nvl, max(acc[6, g], acc[7, g]) * nic)
        out[g] = 2.0 * (d + c)


@njit(cache=True)
def _binds_nvlink(p, s, g):  # pragma: no cover - compiled
    """:func:`_nvlink_binds` for either dispatcher (``s.traffic`` holds the log-miss sums for deepep)."""
    if not p.deepep:
        return _nvlink_binds(s.traffic, p.gpn, p.nvl, p.nic, g)
    return _binds_in(_deepep_link_totals(s.traffic, p.tok, p.gpn)[:, g].copy(), p.nvl, p.nic)


_NO_OVERLAP = np.zeros(0)
"""``_Problem.ov`` without ``cluster.ep_overlap``."""
BOUND_SLACK = 1e-9
"""Relative slack of :func:`_comm_lower_bound` against the rounding of a different summation order."""
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
    """Token equivalents per token on one NVLink direction in one all-to-all phase."""
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
    """float64 [6] under ``cluster.ep_overlap`` (empty: the objective is ``T_MoE``), token equivalents: the
    micro-batch's attention, the all-to-all latency, then ``(compute, comm)`` of the previous and of the
    next micro-batch (compute negative where there is none); see :func:`_combine`."""


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
    x, home, gpn, r, fixed, nvl, nic, sweeps, max_tries, rel_tol, top_k=0, ov=_NO_OVERLAP
):  # pragma: no cover
    """``top_k > 0``: the ``deepep`` estimate with ``T_j = sum_e x[j, e] / top_k``; 0: ``alltoall``.
    ``ov``: :attr:`_Problem.ov`."""
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
        x, tot, home, home // gpn, gpn, r, fixed, nvl, nic, sweeps, max_tries, rel_tol, top_k > 0, lq, tok, ov
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
    return microbatch_share(t_comp + p.ov[0], t_comm + p.ov[1], p.ov[2:], math.inf)


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
        bound = _combine(p, t_comp, _comm_lower_bound(s.traffic, p.gpn, p.nvl, p.nic, np.argmax(s.comm)))
        if bound >= thr:
            return bound
    _comm_into(p, s)
    return _combine(p, t_comp, s.comm.max())


@njit(cache=True, inline="always")
def _comm_into(p, s):  # pragma: no cover - compiled
    """``s.comm`` from ``s.traffic`` by the problem's dispatcher."""
    if p.deepep:
        _comm_from_totals(_deepep_link_totals(s.traffic, p.tok, p.gpn), p.nvl, p.nic, s.comm)
    else:
        _comm_per_gpu(s.traffic, p.gpn, p.nvl, p.nic, s.comm)


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
    x, home, gpn, r, fixed, nvl, nic, mode, sweeps, max_tries, rel_tol, polish_moves, polish_cands, top_k, ov
):  # pragma: no cover
    """x [P, G, E] float64, home [P, E] -> assign int64 [P, E, G], replicas int64 [P, G, r].

    ``ov`` [P, 6] (:attr:`_Problem.ov` of each problem) under ``cluster.ep_overlap``, else [0, 6].

    ``mode``: 0 compute-only acceptance; 1 compute-plus-comm acceptance; 2 three runs, the best kept
    (mode 1, mode 1 with the communication-driven move tried first, and the compute-driven run returning its
    best state along the way). ``polish_moves > 0``: then :func:`_polish` on the kept state.
    """
    p_n, g_n, e_n = x.shape
    assign = np.zeros((p_n, e_n, g_n), np.int64)
    replicas = -np.ones((p_n, g_n, r), np.int64)
    for q in range(p_n):
        ov_q = ov[q] if ov.shape[0] > 0 else _NO_OVERLAP
        p = _problem(x[q], home[q], gpn, r, fixed, nvl, nic, sweeps, max_tries, rel_tol, top_k, ov_q)
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


# ------------------------------------------------------------------------------------------- public API
def _check(load: np.ndarray, home: np.ndarray, num_gpus: int, gpus_per_node: int, r: int) -> None:
    if load.ndim < 2 or load.shape[-2] != num_gpus:
        raise ValueError(f"load must be [..., G={num_gpus}, E], got shape {load.shape}")
    if home.shape != load.shape[:-2] + load.shape[-1:]:
        raise ValueError(f"home must be [..., E] = {load.shape[:-2] + load.shape[-1:]}, got {home.shape}")
    if home.size and (home.min() < 0 or home.max() >= num_gpus):
        raise ValueError(f"home ids must lie in [0, {num_gpus}), got [{home.min()}, {home.max()}]")
    if num_gpus % gpus_per_node != 0:
        raise ValueError(f"G={num_gpus} is not a multiple of gpus_per_node={gpus_per_node}")
    if r < 0:
        raise ValueError(f"replica_slots must be >= 0, got {r}")
    if np.any(load < 0):
        raise ValueError("load must be non-negative token counts")


def replicate_greedy(
    load: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    split: SplitMethod = "waterfill",
    acceptance: Acceptance = "best",
    sweeps: int = 3,
    max_tries: int = 4,
    rel_tol: float = 1e-9,
    polish_moves: int = 0,
    polish_candidates: int = 3,
    overlap: OverlapNeighbours | None = None,
) -> Replication:
    """Greedy replication of every problem in a stack.

    Args:
        load: [..., G, E] tokens of source GPU ``j`` for expert ``e`` (one or many (micro-batch, layer)).
        home: [..., E] home GPU of each expert (same leading axes).
        cost: the cost model; its :meth:`~CostModel.linear` coefficients define the objective.
        replica_slots: ``r``, replica slots per GPU (the layer-shared buffer).
        split: ``"waterfill"`` (compute-only closed form, compiled) or ``"lp"`` (eq. 7 LP per candidate).
        acceptance: which copies the water-filling greedy keeps. ``"comm"``: those that lower the linearised
            ``T_comp_max + T_comm_max``; ``"compute"``: those that lower ``T_comp_max``; ``"best"`` (default):
            both runs, keeping the one with the lower ``T_MoE``, the compute-driven run cut where its
            ``T_MoE`` was lowest (a copy can lower compute yet raise the busiest link, and a later one undo
            that, so neither rule alone is best everywhere).
        sweeps: water-filling sweeps over the node's replicated experts after each new copy.
        max_tries: experts of the bottleneck GPU tried (by decreasing tokens) before the greedy stops.
        rel_tol: minimal relative objective drop for a replica to be kept.
        polish_moves: after the greedy, at most this many improving exchange moves (drop one copy, add
            another in the same node); 0 disables the polish (``"waterfill"`` only).
        polish_candidates: experts tried per rule and dropped copy by the polish.
        overlap: under ``cluster.ep_overlap``, each problem's attention and neighbours (one row per problem,
            in the order of ``load``'s leading axes): the objective becomes the terms of the overlapped layer
            time the problem's micro-batch enters (:func:`relibra.cost.overlap.microbatch_share`) in place of
            ``T_MoE`` (either split). None: ``T_MoE``.

    Returns:
        :class:`Replication` with ``assign`` int32 [..., E, G] and ``replicas`` int32 [..., G, r].
    """
    load = np.asarray(load)
    home = np.asarray(home)
    cluster = cost.cluster
    g_n, gpn = cluster.num_gpus, cluster.gpus_per_node
    _check(load, home, g_n, gpn, replica_slots)
    lead = load.shape[:-2]
    e_n = load.shape[-1]
    x = np.ascontiguousarray(load.reshape(-1, g_n, e_n), dtype=np.float64)
    h = np.ascontiguousarray(home.reshape(-1, e_n), dtype=np.int64)
    coef = ReplicationCoefficients.from_cost(cost)
    if polish_moves < 0 or polish_candidates < 1:
        raise ValueError(
            f"polish_moves={polish_moves} must be >= 0 and polish_candidates={polish_candidates} >= 1"
        )
    ov = np.zeros((0, 6))
    if overlap is not None:
        if overlap.attention.shape != (x.shape[0],):
            raise ValueError(
                f"overlap has {overlap.attention.shape[0]} rows; expected one per problem ({x.shape[0]})"
            )
        spt = coef.seconds_per_token
        ov = np.empty((x.shape[0], 6))
        ov[:, 0] = overlap.attention / spt
        ov[:, 1] = coef.latency
        ov[:, 2:] = overlap.neighbours / spt
    if split == "lp":
        # NOTE: imported on use, so that the default waterfill split never loads OR-Tools.
        from relibra.planners.replicate.milp import greedy_with_lp_split

        assign, replicas = greedy_with_lp_split(
            x, h, cost, replica_slots, max_tries=max_tries, rel_tol=rel_tol, overlap=overlap
        )
    elif split == "waterfill":
        if acceptance not in _MODES:
            raise ValueError(f"acceptance must be one of {sorted(_MODES)}, got {acceptance!r}")
        assign, replicas = _greedy_batch(
            x,
            h,
            gpn,
            max(replica_slots, 1),
            coef.fixed_tokens,
            coef.nvlink_per_token,
            coef.nic_per_token,
            _MODES[acceptance],
            sweeps,
            max_tries if replica_slots > 0 else 0,
            rel_tol,
            polish_moves if replica_slots > 0 else 0,
            polish_candidates,
            cost.model.top_k if cost.dispatcher == "deepep" else 0,
            ov,
        )
        replicas = replicas[..., :replica_slots]
    else:
        raise ValueError(f"split must be 'waterfill' or 'lp', got {split!r}")
    return Replication(
        assign=assign.reshape(*lead, e_n, g_n).astype(np.int32),
        replicas=replicas.reshape(*lead, g_n, replica_slots).astype(np.int32),
    )


def linear_objective(load: np.ndarray, assign: np.ndarray, home: np.ndarray, cost: CostModel) -> np.ndarray:
    """Linearised ``T_MoE`` in seconds, the objective both the greedy and the MILP minimise.

    load [..., G, E], assign [..., E, G], home [..., E] -> float64 [...]. Every expert is charged its fixed
    cost at home (``z = 1`` there) and on every other GPU where it has tokens; communication follows the
    proportional split rule exactly.
    """
    coef = ReplicationCoefficients.from_cost(cost)
    g_n = cost.cluster.num_gpus
    a = np.asarray(assign, dtype=np.float64)
    at_home = np.arange(g_n) == np.asarray(home)[..., None]  # [..., E, G]
    copies = (a > 0) | at_home
    comp = a.sum(axis=-2) + coef.fixed_tokens * copies.sum(axis=-2)  # [..., G]
    # the cost model's own communication term, by its dispatcher (alltoall: piecewise linear in the traffic)
    comm_s = cost.moe_comm_time(load, assign)  # [..., G]
    return comp.max(axis=-1) * coef.seconds_per_token + comm_s.max(axis=-1)


@dataclass(frozen=True)
class GreedyConfig:
    """Settings of :class:`GreedyReplicator`. These defaults are the only ones: the Hydra node
    ``planner/replicate/greedy`` is generated from them (:mod:`experiments.planner_nodes`); the arguments
    are those of :func:`replicate_greedy`."""

    split: SplitMethod = "waterfill"
    """Token split: ``waterfill`` (compute-only closed form, compiled) or ``lp`` (eq. 7 LP with the
    communication terms, slow)."""
    acceptance: Acceptance = "best"
    """Which copies the greedy keeps: ``best`` (the better of the rules), ``comm`` (those lowering
    ``T_comp max + T_comm max``) or ``compute`` (those lowering ``T_comp max``)."""
    sweeps: int = 3
    max_tries: int = 4
    polish_moves: int = 0
    """Exchange moves after the greedy (drop one copy, add another in the node) while they lower ``T_MoE``;
    0: off."""
    polish_candidates: int = 3
    refill_aware: bool = True
    """Behind a planner, keep only copies that pay for their replica-buffer refill
    (:func:`relibra.planners.refill.replicate_within_window`); False: ``T_MoE`` alone, as the paper."""

    def __post_init__(self) -> None:
        if self.split not in get_args(SplitMethod):
            raise ValueError(f"split={self.split!r}; expected one of {list(get_args(SplitMethod))}")
        if self.acceptance not in get_args(Acceptance):
            raise ValueError(f"acceptance={self.acceptance!r}; expected one of {list(get_args(Acceptance))}")
        counts = (
            ("sweeps", self.sweeps, 1),
            ("max_tries", self.max_tries, 0),
            ("polish_moves", self.polish_moves, 0),
            ("polish_candidates", self.polish_candidates, 1),
        )
        for key, value, least in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key}={value!r}; expected an integer >= {least}")


@dataclass(frozen=True)
class GreedyReplicator:
    """:class:`~relibra.planners.protocols.Replicator` running :func:`replicate_greedy` over a micro-batch's
    layers, with ``replica_slots`` (``r``) slots per GPU and ``config`` (default: :class:`GreedyConfig`'s)."""

    replica_slots: int
    config: GreedyConfig = GreedyConfig()

    @property
    def refill_aware(self) -> bool:
        return self.config.refill_aware

    def with_slots(self, replica_slots: int) -> GreedyReplicator:
        return replace(self, replica_slots=replica_slots)

    def replicate(
        self,
        load: np.ndarray,
        home: np.ndarray,
        ctx: BatchContext,
        overlap: OverlapNeighbours | None = None,
    ) -> Replication:
        """load [L, G, E], home [L, E] -> Replication with assign [L, E, G], replicas [L, G, r]; ``overlap``
        (one row per layer): the overlapped objective (:func:`replicate_greedy`)."""
        c = self.config
        return replicate_greedy(
            load,
            home,
            ctx.cost,
            self.replica_slots,
            split=c.split,
            acceptance=c.acceptance,
            sweeps=c.sweeps,
            max_tries=c.max_tries,
            polish_moves=c.polish_moves,
            polish_candidates=c.polish_candidates,
            overlap=overlap,
        )
