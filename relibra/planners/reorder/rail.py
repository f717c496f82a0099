"""The annealer's state on the rail fabric by route class, for whole-number loads.

Where every load is a whole number (token counts, as every trace gives; :func:`integral_loads`), every link
load is an integer that float64 holds exactly, so the order in which its terms are summed does not change it.
Here the state follows the routes of :func:`relibra.planners.reorder.links.link_routes` by class instead of
through its table: a swap's update (:func:`rail_swap_links`, undone exactly by the inverse swap) and the
state from scratch (:func:`full_state_rail`) give the table's numbers bit for bit in a fraction of its
memory traffic (``benchmarks/bench_reorder.py --sections kernels``). :mod:`relibra.planners.reorder.kernels`
takes this path wherever :func:`integral_loads` holds.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from relibra.planners.reorder.links import NUM_LINKS


@njit(cache=True)
def integral_loads(x: np.ndarray) -> bool:
    """Whether every load of ``x`` is a whole number and their total below 2**52: then every sum of them is
    exact in float64, whatever its order, so the link loads are the same numbers however they are summed."""
    total = 0.0
    for v in x.ravel():
        if v != math.floor(v):
            return False
        total += abs(v)
    return total < 2.0**52


@njit(cache=True, inline="always")
def _rail_route(
    lm: np.ndarray, xb: np.ndarray, xa: np.ndarray, g: int, sign: float, gpn: int, prox: np.ndarray
) -> None:
    """Add ``d_j = sign * (xb[j] - xa[j])`` tokens from every source ``j`` to GPU ``g`` along the routes of
    :func:`relibra.planners.reorder.links.link_routes` (``G / gpn`` nodes of ``gpn``) into one micro-batch's
    link loads ``lm`` [8 * G], by route class: each source's own send and receive entries directly, and
    ``g``'s entries and the cross-rail proxies' once, as sums (``prox`` [N + gpn] is scratch)."""
    g_total = xb.shape[0]
    nodes = g_total // gpn
    ng = g // gpn
    rg = g - ng * gpn
    intra = 0.0  # (1, g): NVLink receive of the node's sources
    remote = 0.0  # (3, g): NIC receive of every other node's sources
    rail = 0.0  # (6, g): combine NIC send to the same-rail sources
    cross = 0.0  # with ``intra``, (4, g): combine NVLink send
    for r in range(gpn):
        prox[nodes + r] = 0.0
    for nj in range(nodes):
        base = nj * gpn
        if nj == ng:  # NVLink: (0, j), (1, g), (4, g), (5, j)
            for rj in range(gpn):
                if rj != rg:
                    j = base + rj
                    d = sign * (xb[j] - xa[j])
                    lm[j] += d
                    lm[5 * g_total + j] += d
                    intra += d
            prox[nj] = 0.0
            continue
        node_cross = 0.0
        for rj in range(gpn):
            j = base + rj
            d = sign * (xb[j] - xa[j])
            lm[7 * g_total + j] += d  # (7, j): combine NIC receive, same rail or cross
            remote += d
            if rj == rg:  # same rail: (2, j), (3, g), (6, g), (7, j)
                lm[2 * g_total + j] += d
                rail += d
            else:  # cross rail: (0, j), (3, g), (4, g), (7, j), and the proxies' (1, 2) and (5, 6)
                lm[j] += d
                node_cross += d
                prox[nodes + rj] += d
        prox[nj] = node_cross
        cross += node_cross
    lm[g_total + g] += intra
    lm[3 * g_total + g] += remote
    lm[4 * g_total + g] += intra + cross
    lm[6 * g_total + g] += rail
    for n in range(nodes):
        if n != ng:  # dispatch proxy (node of the source, rail of g): NVLink receive, NIC send
            lm[g_total + n * gpn + rg] += prox[n]
            lm[2 * g_total + n * gpn + rg] += prox[n]
    for r in range(gpn):
        if r != rg:  # combine proxy (node of g, rail of the source): NVLink send, NIC receive
            lm[5 * g_total + ng * gpn + r] += prox[nodes + r]
            lm[6 * g_total + ng * gpn + r] += prox[nodes + r]


@njit(cache=True)
def rail_swap_links(
    a: int, b: int, p: int, q: int, x: np.ndarray, gpn: int, link: np.ndarray, prox: np.ndarray
) -> None:
    """The link part of the annealer's route-table swap (``kernels._apply_swap``) by route class
    (:func:`_rail_route`), without ``idx``: the same loads bit for bit where :func:`integral_loads` holds
    (each entry's terms are summed in another order), about 2.5 times faster at EP 64
    (``benchmarks/bench_reorder.py --sections kernels``). ``rail_swap_links(b, a, p, q, ...)`` undoes it
    exactly there."""
    for m in range(x.shape[0]):
        _rail_route(link[m], x[m, b], x[m, a], p, 1.0, gpn, prox)
        _rail_route(link[m], x[m, b], x[m, a], q, -1.0, gpn, prox)


@njit(cache=True)
def home_compute(home: np.ndarray, w: np.ndarray, mig: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The compute [Mb, G] and migration [G] parts of :func:`full_state`: each expert's weights ``w`` [Mb, E]
    and migration charge ``mig`` [E, G] on its home GPU, summed in expert order."""
    mb, e_total = w.shape
    g_total = mig.shape[1]
    comp = np.zeros((mb, g_total))
    migr = np.zeros(g_total)
    for e in range(e_total):
        g = home[e]
        migr[g] += mig[e, g]
        for m in range(mb):
            comp[m, g] += w[m, e]
    return comp, migr


@njit(cache=True)
def full_state_rail(
    home: np.ndarray, x: np.ndarray, w: np.ndarray, gpn: int, mig: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The annealer's state from scratch (``kernels.full_state``) on the rail fabric of
    ``link_routes(G // gpn, gpn)``, by route class: each GPU's received tokens per source first, then one
    :func:`_rail_route` per (micro-batch, GPU). The same arrays bit for bit where :func:`integral_loads`
    holds (the link sums in another order), in O(Mb * G * (E + G))."""
    mb, e_total, g_total = x.shape
    comp, migr = home_compute(home, w, mig)
    link = np.zeros((mb, NUM_LINKS * g_total))
    recv = np.zeros((g_total, g_total))  # [g, j]: tokens of source j for GPU g's experts
    none = np.zeros(g_total)
    prox = np.zeros(g_total // gpn + gpn)
    for m in range(mb):
        recv[:, :] = 0.0
        for e in range(e_total):
            g = home[e]
            for j in range(g_total):
                recv[g, j] += x[m, e, j]
        for g in range(g_total):
            _rail_route(link[m], recv[g], none, g, 1.0, gpn, prox)
    return comp, link, migr
