"""The greedy replication's link kernels (numba): per-GPU all-to-all seconds from a traffic matrix, its
incremental per-node rebuild, DeepEP's link totals from log-miss sums, and the cheap bounds the greedy
rejects candidates with. Every one is checked against :mod:`relibra.cost.fabric` in
``tests/cost/test_fabric_kernels.py``."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# ----------------------------------------------------------------------------------------- compiled core

BOUND_SLACK = 1e-9
"""Relative slack of :func:`_comm_lower_bound` against the rounding of a different summation order."""


@njit(cache=True)
def _comm_per_gpu(traffic, gpn, nvl, nic, out, dsc=1.0):  # pragma: no cover - compiled
    """Linearised ``T_comm(g)`` without latency; traffic [G(j), G(g)] dispatch tokens -> out [G].

    ``nvl``, ``nic``: token equivalents per token in a combine phase; a dispatch phase costs ``dsc`` times
    that (its bytes per token over the combine's: 1 for bf16 dispatch, about 0.52 for FP8).

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
    _comm_from_totals(acc, nvl, nic, out, dsc)


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
def _comm_lower_bound(traffic, gpn, nvl, nic, g, dsc=1.0):  # pragma: no cover - compiled
    """A lower bound on what :func:`_comm_per_gpu` gives for GPU ``g`` alone, in O(G).

    :func:`_gpu_link_totals` shrunk by :data:`BOUND_SLACK`, far more than the rounding of either summation
    order (n terms: n * 1.1e-16 relative).
    """
    s = _gpu_link_totals(traffic, gpn, g) * (1.0 - BOUND_SLACK)
    d = max(max(s[0], s[1]) * (nvl * dsc), max(s[2], s[3]) * (nic * dsc))
    c2 = max(max(s[4], s[5]) * nvl, max(s[6], s[7]) * nic)
    return 2.0 * (d + c2)


@njit(cache=True)
def _nvlink_binds(traffic, gpn, nvl, nic, g, dsc=1.0):  # pragma: no cover - compiled
    """Whether NVLink, not the NIC, binds GPU ``g`` in the dispatch or the combine exchange."""
    return _binds_in(_gpu_link_totals(traffic, gpn, g), nvl, nic, dsc)


@njit(cache=True)
def _binds_in(s, nvl, nic, dsc=1.0):  # pragma: no cover - compiled
    """Whether NVLink binds in either exchange, from one GPU's eight link totals ``s`` [8]."""
    dispatch = max(s[0], s[1]) * (nvl * dsc) >= max(s[2], s[3]) * (nic * dsc)
    return dispatch or max(s[4], s[5]) * nvl >= max(s[6], s[7]) * nic


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
def _comm_from_totals(acc, nvl, nic, out, dsc=1.0):  # pragma: no cover - compiled
    """Linearised ``T_comm(g)`` [G] from the eight link totals [8, G] (busiest direction per phase; a
    dispatch phase at ``dsc`` times the combine's coefficients)."""
    for g in range(acc.shape[1]):
        d = max(max(acc[0, g], acc[1, g]) * (nvl * dsc), max(acc[2, g], acc[3, g]) * (nic * dsc))
        c = max(max(acc[4, g], acc[5, g]) * nvl, max(acc[6, g], acc[7, g]) * nic)
        out[g] = 2.0 * (d + c)


@njit(cache=True)
def _binds_nvlink(p, s, g):  # pragma: no cover - compiled
    """:func:`_nvlink_binds` for either dispatcher (``s.traffic`` holds the log-miss sums for deepep)."""
    if not p.deepep:
        return _nvlink_binds(s.traffic, p.gpn, p.nvl, p.nic, g, p.dsc)
    return _binds_in(_deepep_link_totals(s.traffic, p.tok, p.gpn)[:, g].copy(), p.nvl, p.nic, p.dsc)
