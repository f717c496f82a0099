"""The link-class state that the annealer and the locality round search over, on the rail fabric.

Each GPU tracks eight one-way token loads (:data:`NUM_LINKS`): for dispatch and for combine, NVLink send and
receive and rail NIC send and receive. :func:`link_routes` (all-to-all) and :func:`deepep_routes` (DeepEP)
say which of them one token adds to; :func:`comm_gpu` turns a GPU's eight loads into its normalised
all-to-all time. Both :mod:`relibra.planners.reorder.anneal` and :mod:`relibra.planners.reorder.locality` use
them.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from relibra.cost.model import CostModel

__all__ = ["NUM_LINKS", "comm_coefficients", "comm_gpu", "deepep_routes", "fabric_routes", "link_routes"]

NUM_LINKS = 8
"""Per-GPU link-class loads tracked by the search, one-way tokens: dispatch (``0`` NVLink send, ``1`` NVLink
receive, ``2`` NIC send, ``3`` NIC receive), then the same four for combine (the transposed exchange)."""


def link_routes(nodes: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Where one token sent from source ``j`` to computing GPU ``g`` is counted, per the rail fabric.

    Mirrors :meth:`CostModel.link_bytes` for the dispatch exchange ``j -> g`` and the combine exchange
    ``g -> j``: intra-node traffic uses NVLink; same-rail inter-node traffic the rail NIC; cross-rail
    inter-node traffic an NVLink hop to the proxy ``(node of sender, rail of receiver)`` and then that proxy's
    NIC.

    Returns:
        idx int32 [G, G, 8]: flat index ``link * G + gpu`` into a per-GPU link state [8, G] (see
        :data:`NUM_LINKS`), padded with -1; count int32 [G, G]: valid entries of ``idx[j, g]``.
    """
    idx, count = _link_routes(nodes, gpus_per_node)
    return idx.copy(), count.copy()


def fabric_routes(
    routes: tuple[np.ndarray, np.ndarray] | None, nodes: int, gpus_per_node: int
) -> tuple[np.ndarray, np.ndarray]:
    """The routes a kernel reads: :func:`link_routes` of the fabric (shared, not to be written), after
    checking that ``routes`` a caller passed are those. The annealer follows the rail fabric by route class
    wherever the loads are whole numbers, so other routes cannot be honoured and are refused."""
    idx, count = _link_routes(nodes, gpus_per_node)
    if routes is not None and not (np.array_equal(routes[0], idx) and np.array_equal(routes[1], count)):
        raise ValueError(
            f"routes are not link_routes({nodes}, {gpus_per_node}), the rail fabric of the cluster; the "
            "annealer prices that fabric only"
        )
    return idx, count


@functools.lru_cache(maxsize=16)
def _link_routes(nodes: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`link_routes`, built once per fabric shape (a control-plane worker plans every layer of every
    batch on one shape; the build is a Python loop over ``G^2`` pairs, milliseconds at EP 64). Callers get
    copies, so a caller that writes into its arrays cannot change another's."""
    g_total = nodes * gpus_per_node
    idx = np.full((g_total, g_total, NUM_LINKS), -1, dtype=np.int32)
    count = np.zeros((g_total, g_total), dtype=np.int32)
    for j in range(g_total):
        nj, rj = divmod(j, gpus_per_node)
        for g in range(g_total):
            ng, rg = divmod(g, gpus_per_node)
            if j == g:
                continue
            entries: list[tuple[int, int]] = []
            if nj == ng:  # intra-node, NVLink
                entries += [(0, j), (1, g), (4, g), (5, j)]
            elif rj == rg:  # same rail, NIC only
                entries += [(2, j), (3, g), (6, g), (7, j)]
            else:  # cross rail: NVLink hop on the sender's node, then the proxy's NIC
                proxy_d = nj * gpus_per_node + rg  # dispatch j -> g
                proxy_c = ng * gpus_per_node + rj  # combine g -> j
                entries += [(0, j), (1, proxy_d), (2, proxy_d), (3, g)]
                entries += [(4, g), (5, proxy_c), (6, proxy_c), (7, j)]
            count[j, g] = len(entries)
            for k, (link, gpu) in enumerate(entries):
                idx[j, g, k] = link * g_total + gpu
    return idx, count


def deepep_routes(nodes: int, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where DeepEP's de-duplicated tokens are counted (:func:`relibra.cost.fabric.deepep_link_tokens`).

    A token of source ``j`` reaching GPU ``g`` over NVLink (``g`` is neither ``j`` nor the GPU that got it
    over RDMA) is one dispatch NVLink receive at ``g`` and send at its sender (``j`` on ``j``'s node, else
    ``(node of g, rail of j)``); a token of ``j`` reaching remote node ``b`` is one NIC send at ``j`` and
    receive at ``(b, rail of j)``. Combine mirrors both (links 4-7 of :data:`NUM_LINKS`, send and receive
    swapped).

    Returns:
        gidx int32 [G, G, 4], gcnt int32 [G, G] (4 or 0) for the GPU entries; nidx int32 [G, N, 4],
        ncnt int32 [G, N] for the node entries; flat indices ``link * G + gpu`` as :func:`link_routes`.
    """
    gpn = gpus_per_node
    g_total = nodes * gpn
    j = np.arange(g_total)[:, None]
    g = np.arange(g_total)[None, :]
    same_node = j // gpn == g // gpn
    forwarder = np.where(same_node, g == j, g % gpn == j % gpn)
    sender = np.where(same_node, j, (g // gpn) * gpn + j % gpn)
    gidx = np.stack(
        [g_total + g + 0 * j, sender, 4 * g_total + g + 0 * j, 5 * g_total + sender], axis=-1
    ).astype(np.int32)
    gcnt = np.where(forwarder, 0, 4).astype(np.int32)
    b = np.arange(nodes)[None, :]
    recv = b * gpn + j % gpn  # [G, N]
    jj = j + 0 * b
    nidx = np.stack(
        [2 * g_total + jj, 3 * g_total + recv, 6 * g_total + recv, 7 * g_total + jj], axis=-1
    ).astype(np.int32)
    ncnt = np.where(j // gpn == b, 0, 4).astype(np.int32)
    return gidx, gcnt, nidx, ncnt


def comm_coefficients(cost: CostModel) -> np.ndarray:
    """The ``coef`` of :func:`comm_gpu` in seconds: float64 [5], seconds per token on one NVLink direction
    and on one rail NIC direction in one dispatch phase, the same in one combine phase
    (:meth:`CostModel.linear`: each phase at its own bytes per token, so FP8 dispatch is priced exactly),
    and the 4 phases' fixed latency (0 on one GPU)."""
    lin = cost.linear()
    lat = 4.0 * cost.cluster.hardware.alltoall_latency_s if cost.cluster.num_gpus > 1 else 0.0
    return np.array(
        [
            lin.nvlink_dispatch_s_per_token,
            lin.rdma_dispatch_s_per_token,
            lin.nvlink_combine_s_per_token,
            lin.rdma_combine_s_per_token,
            lat,
        ]
    )


@njit(cache=True)
def comm_gpu(link_m: np.ndarray, g: int, g_total: int, coef: np.ndarray) -> float:
    """Normalised all-to-all time of GPU ``g`` from its eight link loads (4 phases plus latency); ``coef``
    [5] as :func:`comm_coefficients` (dispatch NVLink, NIC; combine NVLink, NIC; latency)."""
    d = max(
        coef[0] * max(link_m[g], link_m[g_total + g]),
        coef[1] * max(link_m[2 * g_total + g], link_m[3 * g_total + g]),
    )
    c = max(
        coef[2] * max(link_m[4 * g_total + g], link_m[5 * g_total + g]),
        coef[3] * max(link_m[6 * g_total + g], link_m[7 * g_total + g]),
    )
    return 2.0 * (d + c) + coef[4]
