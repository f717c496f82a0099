"""The rail-optimized fabric: which bytes cross which link for each dispatcher (docs/spine.md, "Cost model").

GPU ``g`` sits on node ``g // gpus_per_node`` and rail ``g % gpus_per_node``; each GPU has one NIC on its
rail and NVLink to every GPU of its node. Here a "node" is an NVLink domain: callers pass
``ClusterSpec.num_domains`` and ``ClusterSpec.domain_gpus`` (``cluster.nvl_domain``, by default the 8-GPU
node; 72 GPUs on GB200 NVL72, where a domain spans trays and a GPU's rail is its position in the domain).
Two dispatchers move a token's hidden state to the GPUs that compute its experts and back:

* ``alltoall``: Megatron-core's ``MoEAlltoAllTokenDispatcher``. Its ``preprocess`` sets the all-to-all
  input splits to the per-rank sums of ``num_local_tokens_per_expert`` (``routing_map.sum(dim=0)``), so one
  row travels per (token, expert) pair: a token with two experts on one GPU crosses twice. NCCL routes a
  cross-rail message over NVLink to the source node's GPU of the destination rail, then over that rail's
  NIC (PXN), as :func:`rail_link_bytes` prices a ``[G, G]`` traffic matrix.
* ``deepep``: DeepEP's internode normal kernels (Megatron's flex dispatcher). A token crosses to each
  remote node that holds any of its experts once, over the source GPU's own NIC to the GPU of the same
  rail there, which forwards it over NVLink once to each other GPU of that node that holds any of its
  experts; GPUs of the source node get it over NVLink, once per GPU. Combine mirrors it (partial sums are
  reduced per GPU, then at the forwarder): the same counts with send and receive swapped.
  :func:`deepep_link_tokens` counts this exactly from per-token routes; :func:`deepep_link_tokens_estimate`
  estimates it from per-source loads ``x[j, e]`` and tokens ``T_j`` (independent top-k slots), which is
  what per-sample counts allow; the estimate's error is measured by ``python -m experiments.validate``.

Every function returns per-GPU counts on the four link directions ``nvlink_send``, ``nvlink_recv``,
``nic_send``, ``nic_recv`` (:data:`LINK_KEYS`), broadcasting over leading axes.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from relibra import numerics

__all__ = [
    "DISPATCHERS",
    "DISPATCHER_COMM_SMS",
    "LINK_KEYS",
    "Dispatcher",
    "alltoall_traffic",
    "deepep_link_tokens",
    "deepep_link_tokens_estimate",
    "mirrored",
    "rail_link_bytes",
]

Dispatcher = Literal["alltoall", "deepep"]
DISPATCHERS: tuple[str, ...] = ("alltoall", "deepep")
DISPATCHER_COMM_SMS = {"alltoall": 0, "deepep": 20}
"""SMs each dispatcher's dispatch and combine kernels hold while they run (``cluster.comm_sms`` when null;
:mod:`relibra.cost.overlap` charges the compute beside them for it). ``deepep``: DeepEP's ``Buffer.num_sms``
default (deep_ep/buffers/legacy.py: 20; a HybridEP recipe sets its own, e.g. Megatron-Bridge's
``moe_hybridep_num_sms = 32``). ``alltoall``: 0, NCCL's all-to-all channels are not priced (NCCL chooses
its CTA count at run time; no measurement of it for these runs is in experiments/data)."""
LINK_KEYS = ("nvlink_send", "nvlink_recv", "nic_send", "nic_recv")


def rail_link_bytes(traffic: np.ndarray, nodes: int, gpus_per_node: int) -> dict[str, np.ndarray]:
    """Per-GPU bytes on each link direction for a one-way exchange ``traffic`` [..., G(j), G(g)].

    Same GPU: free. Same node: NVLink. Other node, same rail: the rail NIC. Other node, other rail: an
    NVLink hop to the source node's GPU on the destination rail (the proxy), then that rail's NIC.
    Returns the :data:`LINK_KEYS`, each [..., G].
    """
    n, r = nodes, gpus_per_node
    t = np.asarray(traffic, dtype=np.float64)
    lead = t.shape[:-2]
    t5 = t.reshape(*lead, n, r, n, r)  # [..., n_src, r_src, n_dst, r_dst]
    same_node = np.eye(n, dtype=bool)[:, None, :, None]
    same_rail = np.eye(r, dtype=bool)[None, :, None, :]
    intra = np.where(same_node & ~same_rail, t5, 0.0)
    inter = np.where(~same_node, t5, 0.0)
    cross = np.where(~same_node & ~same_rail, t5, 0.0)
    nvl_send = intra.sum(axis=(-2, -1)) + cross.sum(axis=(-2, -1))
    proxy = cross.sum(axis=(-3, -2))  # [..., n_src, r_dst]: the proxy receives its node peers' cross traffic
    nvl_recv = intra.sum(axis=(-4, -3)) + proxy
    nic_send = inter.sum(axis=(-3, -2))  # leaves from the proxy (n_src, r_dst)
    nic_recv = inter.sum(axis=(-4, -3))  # lands on (n_dst, r_dst)
    g = n * r
    return {
        "nvlink_send": nvl_send.reshape(*lead, g),
        "nvlink_recv": nvl_recv.reshape(*lead, g),
        "nic_send": nic_send.reshape(*lead, g),
        "nic_recv": nic_recv.reshape(*lead, g),
    }


def mirrored(links: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """DeepEP's combine from its dispatch: the same counts with send and receive swapped on each link."""
    return {
        "nvlink_send": links["nvlink_recv"],
        "nvlink_recv": links["nvlink_send"],
        "nic_send": links["nic_recv"],
        "nic_recv": links["nic_send"],
    }


def alltoall_traffic(dest_gpu: np.ndarray, src_gpu: np.ndarray, num_gpus: int) -> np.ndarray:
    """Megatron all-to-all rows from per-token routes: one per (token, expert) pair.

    dest_gpu int [T, k] (GPU computing each of a token's k experts), src_gpu int [T] -> float64 [G, G].
    """
    d = np.asarray(dest_gpu, dtype=np.int64)
    s = np.broadcast_to(np.asarray(src_gpu, dtype=np.int64)[:, None], d.shape)
    flat = np.bincount((s * num_gpus + d).ravel(), minlength=num_gpus * num_gpus)
    return flat.reshape(num_gpus, num_gpus).astype(np.float64)


def _forwarder_mask(src_gpu: np.ndarray, nodes: int, gpus_per_node: int) -> np.ndarray:
    """bool [T, G]: GPU g receives token t straight from its source (the source itself or its rail peer)."""
    g = np.arange(nodes * gpus_per_node)
    src = np.asarray(src_gpu, dtype=np.int64)[:, None]
    same_node = (g // gpus_per_node) == (src // gpus_per_node)
    return np.where(same_node, g == src, (g % gpus_per_node) == (src % gpus_per_node))


def deepep_link_tokens(
    dest_gpu: np.ndarray, src_gpu: np.ndarray, nodes: int, gpus_per_node: int
) -> dict[str, np.ndarray]:
    """Exact DeepEP dispatch token counts per GPU and link direction from per-token routes.

    dest_gpu int [T, k] (GPU computing each of a token's experts), src_gpu int [T] (the GPU holding the
    token) -> :data:`LINK_KEYS`, each float64 [G] (tokens; multiply by bytes per token).
    """
    gpn = gpus_per_node
    g = nodes * gpn
    d = np.asarray(dest_gpu, dtype=np.int64)
    src = np.asarray(src_gpu, dtype=np.int64)
    t = d.shape[0]
    hit = np.zeros((t, g), dtype=bool)  # token t goes to GPU g at least once
    hit[np.arange(t)[:, None], d] = True
    node_hit = np.asarray(hit.reshape(t, nodes, gpn).any(axis=-1))  # [T, N]
    src_node, src_rail = src // gpn, src % gpn
    remote = node_hit.copy()
    remote[np.arange(t), src_node] = False
    # RDMA: the source's NIC sends once per remote node; that node's GPU on the source rail receives it.
    nic_send = np.bincount(src, weights=remote.sum(axis=1), minlength=g)
    rn, rb = np.nonzero(remote)
    nic_recv = np.bincount(rb * gpn + src_rail[rn], minlength=g).astype(np.float64)
    # NVLink: every GPU the token reaches other than the one that got it straight from the source.
    hop = hit & ~_forwarder_mask(src, nodes, gpn)
    ht, hg = np.nonzero(hop)
    sender = np.where(hg // gpn == src_node[ht], src[ht], (hg // gpn) * gpn + src_rail[ht])
    return {
        "nvlink_send": np.bincount(sender, minlength=g).astype(np.float64),
        "nvlink_recv": hop.sum(axis=0).astype(np.float64),
        "nic_send": nic_send.astype(np.float64),
        "nic_recv": nic_recv,
    }


def deepep_link_tokens_estimate(
    load: np.ndarray, share: np.ndarray, tokens: np.ndarray, nodes: int, gpus_per_node: int
) -> dict[str, np.ndarray]:
    """DeepEP dispatch token counts estimated from per-source loads (no per-token routes).

    load [..., G(j), E] (``x[j, e]``), share [..., E, G(g)] (fraction of expert e's tokens computed on g;
    rows sum to 1), tokens [..., G(j)] (tokens held by source j, each with k routed slots). A token of j
    picks expert e with probability ``q = x[j, e] / T_j``; its slots are taken as independent, so it misses
    GPU set S with probability ``prod_e (1 - q_e) ** share[e, S]``. Returns :data:`LINK_KEYS` [..., G].
    """
    gpn = gpus_per_node
    x = np.asarray(load, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.float64)
    s = np.asarray(share, dtype=np.float64)
    q = np.divide(x, tok[..., None], out=np.zeros_like(x), where=tok[..., None] > 0)
    q = np.minimum(q, 1.0)
    g = x.shape[-2]

    # NOTE: log P(miss) = sum_e share[e, X] * log(1 - q_e): exact for a single copy (share 0 or 1); for a
    # split expert it treats the copies as (1 - q)^share, within O(q^2) of 1 - q * share. It is linear in
    # the share, one matmul for all sources.
    lq = numerics.log1p(-np.minimum(q, 1.0 - 1e-12))  # [..., G(j), E]
    log_miss_gpu = numerics.matmul(lq, s)  # [..., G(j), G(g)]
    s_node = s.reshape(*s.shape[:-1], nodes, gpn).sum(axis=-1)  # [..., E, N]
    log_miss_node = numerics.matmul(lq, s_node)  # [..., G(j), N]
    hit_gpu = tok[..., None] * -numerics.expm1(log_miss_gpu)  # tokens of j reaching GPU g
    hit_node = tok[..., None] * -numerics.expm1(log_miss_node)  # tokens of j reaching node b
    jj = np.arange(g)
    src_node = jj // gpn
    remote = src_node[:, None] != np.arange(nodes)[None, :]  # [G(j), N]
    rnode = np.where(remote, hit_node, 0.0)
    nic_send = rnode.sum(axis=-1)
    # Receiver of j's RDMA for node b: (b, rail(j)); sum over the sources of each rail.
    rail = jj % gpn
    onehot_rail = (rail[:, None] == np.arange(gpn)[None, :]).astype(np.float64)  # [G(j), R]
    nic_recv = np.einsum("...jb,jr->...br", rnode, onehot_rail).reshape(*rnode.shape[:-2], g)
    fwd = _forwarder_mask(jj, nodes, gpn)  # [G(j), G(g)]
    hop = np.where(fwd, 0.0, hit_gpu)  # [..., G(j), G(g)]
    nvl_recv = hop.sum(axis=-2)
    # Sender of a hop j -> g: j on its own node, else (node(g), rail(j)).
    same = src_node[:, None] == (jj // gpn)[None, :]
    local = np.where(same, hop, 0.0).sum(axis=-1)  # [..., G(j)] sent by j itself
    far = np.where(same, 0.0, hop)  # [..., G(j), G(g)] forwarded by (node(g), rail(j))
    far5 = far.reshape(*far.shape[:-2], nodes, gpn, nodes, gpn).sum(axis=(-4, -1))  # [..., R(j), N(g)]
    forwarded = np.swapaxes(far5, -1, -2).reshape(*far.shape[:-2], g)  # GPU (b, r)
    return {
        "nvlink_send": local + forwarded,
        "nvlink_recv": nvl_recv,
        "nic_send": nic_send,
        "nic_recv": nic_recv,
    }
