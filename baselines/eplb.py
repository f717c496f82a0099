"""EPLB+: DeepSeek's expert-parallelism load balancer, re-planned per batch from oracle loads.

Source: deepseek-ai/EPLB, ``eplb.py`` (``balanced_packing``, ``replicate_experts``,
``rebalance_experts_hierarchical``, ``rebalance_experts``). This module re-implements the published
algorithm in numpy with the same vocabulary and outputs, and pins the README's worked example in
``tests/baselines/test_eplb.py``.

Vocabulary (EPLB's): a *logical* expert is one of the model's ``E`` experts; a *physical* expert is one
slot holding a copy of a logical expert's weights. With ``R`` redundant slots per GPU there are
``E + G * R`` physical experts, ``E / G + R`` per GPU. ``phy2log [L, E + G*R]`` names the logical expert
of every physical slot (slot ``p`` lives on GPU ``p // (E/G + R)``), ``log2phy [L, E, X]`` lists the
physical slots of each logical expert (-1 padded) and ``logcnt [L, E]`` counts them.

The algorithm:
1. (hierarchical) pack expert groups onto nodes so that node loads are even (``balanced_packing``);
2. inside each node, give each redundant slot to the expert with the highest load per copy
   (``replicate_experts``);
3. pack the physical experts onto the node's GPUs, the same number on each, loads as even as possible.
The global policy is the same function with one group and one node. ``rebalance_experts`` picks the
hierarchical policy when the groups divide evenly over the nodes, the global one otherwise.

"+" (the paper's baseline): in ``load_mode="oracle"`` the planner re-plans every batch from that batch's
exact per-expert loads; ``load_mode="history"`` uses the moving average of earlier batches, which is how
EPLB runs in practice. Tokens of an expert are split evenly over its copies, as EPLB assumes.

Known weaknesses kept visible, not fixed: one placement per batch (no micro-batch granularity), no
communication cost in the objective, and two copies of one expert may land on one GPU (that GPU then
computes the expert once, with both shares). Redundant slots hold weights permanently in every layer:
``L * R`` experts per GPU (``stats["redundant_experts_per_gpu"]`` and ``stats["redundant_bytes_per_gpu"]``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from ortools.graph.python import max_flow

from relibra.planners.protocols import BatchContext, SlotBudget
from relibra.relabel import relabel_for
from relibra.types import BatchPlan

__all__ = [
    "EplbPlanner",
    "balanced_packing",
    "copies_per_gpu",
    "even_split",
    "history_weight",
    "rebalance_experts",
    "replicate_experts",
]

Policy = Literal["hierarchical", "global", "auto"]
LoadMode = Literal["oracle", "history"]


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each.

    Items are taken heaviest first; each goes to the lightest pack that still has room.

    Parameters:
        weight: [X, n], the weight of each item
        num_packs: number of packs (divides ``n``)

    Returns:
        pack_index: int64 [X, n], the pack of each item
        rank_in_pack: int64 [X, n], the position of the item inside its pack
    """
    num_rows, num_items = weight.shape
    assert num_items % num_packs == 0, f"{num_items} items do not split evenly into {num_packs} packs"
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_index = np.broadcast_to(np.arange(num_items, dtype=np.int64), weight.shape).copy()
        return pack_index, np.zeros_like(pack_index)

    # NOTE: a stable sort of the negated weights orders ties by index, as the reference's sort does on
    # the README example; other tie orders are equally valid packings.
    order = np.argsort(-np.asarray(weight, dtype=np.float64), axis=-1, kind="stable")
    pack_index = np.full(weight.shape, -1, dtype=np.int64)
    rank_in_pack = np.full(weight.shape, -1, dtype=np.int64)
    for i in range(num_rows):
        pack_weight = np.zeros(num_packs)
        pack_items = np.zeros(num_packs, dtype=np.int64)
        for item in order[i]:
            open_weight = np.where(pack_items < items_per_pack, pack_weight, np.inf)
            pack = int(np.argmin(open_weight))
            pack_index[i, item] = pack
            rank_in_pack[i, item] = pack_items[pack]
            pack_weight[pack] += weight[i, item]
            pack_items[pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``num_log`` logical experts into ``num_phy`` physical ones, minimising the max load per copy.

    Each extra slot goes to the expert with the highest ``weight / logcnt`` (first index on ties).

    Parameters:
        weight: [X, num_log]
        num_phy: physical experts after replication (``>= num_log``)

    Returns:
        phy2log: int64 [X, num_phy], logical expert of each physical expert
        rank: int64 [X, num_phy], replica rank of each physical expert (0 for the first copy)
        logcnt: int64 [X, num_log], copies of each logical expert
    """
    num_rows, num_log = weight.shape
    assert num_phy >= num_log, f"num_phy={num_phy} must be >= the {num_log} logical experts"
    rows = np.arange(num_rows)
    phy2log = np.broadcast_to(np.arange(num_phy, dtype=np.int64), (num_rows, num_phy)).copy()
    rank = np.zeros((num_rows, num_phy), dtype=np.int64)
    logcnt = np.ones((num_rows, num_log), dtype=np.int64)
    w = np.asarray(weight, dtype=np.float64)
    for i in range(num_log, num_phy):
        hot = np.argmax(w / logcnt, axis=-1)  # [X]
        phy2log[:, i] = hot
        rank[:, i] = logcnt[rows, hot]
        logcnt[rows, hot] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    """Inverse of each row permutation. perm [X, n] -> [X, n]."""
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[-1]), perm.shape), axis=-1)
    return inv


def _rebalance_hierarchical(
    weight: np.ndarray, num_physical_experts: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hierarchical policy. weight [L, E] -> phy2log [L, P], phyrank [L, P], logcnt [L, E] (P physical)."""
    num_layers, num_log = weight.shape
    assert num_log % num_groups == 0, f"{num_log} experts do not split into {num_groups} groups"
    group_size = num_log // num_groups
    assert num_groups % num_nodes == 0, f"{num_groups} groups do not split over {num_nodes} nodes"
    groups_per_node = num_groups // num_nodes
    assert num_gpus % num_nodes == 0, f"{num_gpus} GPUs do not split over {num_nodes} nodes"
    assert num_physical_experts % num_gpus == 0, f"{num_physical_experts} slots do not split over GPUs"
    phy_per_gpu = num_physical_experts // num_gpus
    log_per_node = num_log // num_nodes

    # Step 1: pack groups onto nodes; "mlog" numbers logical experts node by node.
    tokens_per_group = weight.reshape(num_layers, num_groups, group_size).sum(-1)  # [L, num_groups]
    group_pack, group_rank = balanced_packing(tokens_per_group, num_nodes)
    log2mlog = (
        ((group_pack * groups_per_node + group_rank) * group_size)[..., None] + np.arange(group_size)
    ).reshape(num_layers, num_log)  # [L, E]
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate inside each node. [L * N, E / N]
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(-1, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_per_mlog, num_physical_experts // num_nodes)

    # Step 3: pack physical experts onto the node's GPUs. [L * N, P / N]
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt, phy2mlog, -1)
    pack_index, rank_in_pack = balanced_packing(tokens_per_phy, num_gpus // num_nodes)
    phy2pphy = pack_index * phy_per_gpu + rank_in_pack
    pphy2phy = _inverse(phy2pphy)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)  # [L * N, P / N]
    pphy2mlog = (
        pphy2mlog.reshape(num_layers, num_nodes, -1) + np.arange(0, num_log, log_per_node)[None, :, None]
    ).reshape(num_layers, -1)  # [L, P]
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(num_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(num_layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(
    weight: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: Policy = "auto",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point.

    Parameters:
        weight: [L, E], load of every logical expert
        num_replicas: physical experts in all, a multiple of ``num_gpus``
        num_groups: expert groups (group-limited routing); ``E`` when the model has none
        num_nodes: server nodes (NVLink domains)
        num_gpus: GPUs, a multiple of ``num_nodes``
        policy: ``auto`` (EPLB's rule: hierarchical iff ``num_groups % num_nodes == 0``),
            ``hierarchical`` or ``global``

    Returns:
        phy2log: int64 [L, num_replicas], logical expert of each physical slot
        log2phy: int64 [L, E, X], physical slots of each logical expert (-1 padded), X = max copies
        logcnt: int64 [L, E], copies of each logical expert
    """
    weight = np.asarray(weight, dtype=np.float64)
    if weight.ndim != 2:
        raise ValueError(f"weight has shape {weight.shape}; expected [layers, logical experts]")
    num_layers, num_log = weight.shape
    if num_replicas < num_log or num_replicas % num_gpus != 0:
        raise ValueError(
            f"num_replicas={num_replicas} must be >= the {num_log} logical experts and a multiple of "
            f"num_gpus={num_gpus}"
        )
    hierarchical = num_groups % num_nodes == 0 if policy == "auto" else policy == "hierarchical"
    if policy == "hierarchical" and num_groups % num_nodes != 0:
        raise ValueError(
            f"policy=hierarchical needs num_groups={num_groups} divisible by num_nodes={num_nodes}"
        )
    if hierarchical:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phyrank, logcnt = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    max_cnt = int(logcnt.max())
    log2phy = np.full((num_layers, num_log * max_cnt), -1, dtype=np.int64)
    np.put_along_axis(
        log2phy,
        phy2log * max_cnt + phyrank,
        np.broadcast_to(np.arange(num_replicas), (num_layers, num_replicas)),
        axis=-1,
    )
    return phy2log, log2phy.reshape(num_layers, num_log, max_cnt), logcnt


# ------------------------------------------------------------------------------------ plan helpers
def copies_per_gpu(phy2log: np.ndarray, num_experts: int, num_gpus: int) -> np.ndarray:
    """Copies of each logical expert on each GPU. phy2log [L, P] -> int64 [L, E, G]."""
    num_layers, num_phy = phy2log.shape
    gpu_of_slot = np.arange(num_phy) // (num_phy // num_gpus)  # [P]
    copies = np.zeros((num_layers, num_experts, num_gpus), dtype=np.int64)
    layer = np.broadcast_to(np.arange(num_layers)[:, None], phy2log.shape)
    np.add.at(copies, (layer, phy2log, np.broadcast_to(gpu_of_slot, phy2log.shape)), 1)
    return copies


def even_split(total: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """Split each expert's tokens evenly over its copies, as EPLB assumes.

    ``assign[e, g] = total[e] * copies[e, g] / logcnt[e]``, rounded by largest remainder so that every
    expert's tokens add up exactly.

    total int [..., E] tokens of each expert, copies int [..., E, G] (broadcast against total's
    leading axes) -> assign int32 [..., E, G].
    """
    total = np.asarray(total, dtype=np.int64)
    copies = np.asarray(copies, dtype=np.int64)
    logcnt = copies.sum(-1, keepdims=True)
    exact = total[..., None] * copies  # numerator of the share, [..., E, G]
    base = exact // logcnt
    frac = exact - base * logcnt  # remainder (numerator), order-equivalent to the fractional part
    deficit = total - base.sum(-1)  # [..., E], < number of copies
    order = np.argsort(-frac, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(order.shape[-1]), order.shape), axis=-1)
    return (base + (rank < deficit[..., None])).astype(np.int32)


def _choose_home(copies: np.ndarray, per_gpu: int) -> np.ndarray:
    """Name one copy of each expert its home, ``per_gpu`` homes per GPU where the copies allow it.

    A maximum bipartite b-matching (experts -> GPUs holding a copy, capacity ``per_gpu``) per layer; an
    expert left over (only when no balanced choice exists) goes to its holder with the fewest homes.
    copies [L, E, G] -> home int32 [L, E].
    """
    num_layers, num_experts, num_gpus = copies.shape
    home = np.empty((num_layers, num_experts), dtype=np.int32)
    src, sink = num_experts + num_gpus, num_experts + num_gpus + 1
    for l in range(num_layers):
        e_idx, g_idx = np.nonzero(copies[l] > 0)
        flow = max_flow.SimpleMaxFlow()
        tails = np.concatenate([np.full(num_experts, src), e_idx, num_experts + np.arange(num_gpus)])
        heads = np.concatenate([np.arange(num_experts), num_experts + g_idx, np.full(num_gpus, sink)])
        caps = np.concatenate([np.ones(num_experts), np.ones(len(e_idx)), np.full(num_gpus, per_gpu)])
        arcs = flow.add_arcs_with_capacity(tails, heads, caps.astype(np.int64))
        flow.solve(src, sink)
        used = flow.flows(arcs[num_experts : num_experts + len(e_idx)]) > 0
        home[l] = -1
        home[l, e_idx[used]] = g_idx[used]
        for e in np.flatnonzero(home[l] < 0):
            holders = np.flatnonzero(copies[l, e] > 0)
            homes = np.bincount(home[l][home[l] >= 0], minlength=num_gpus)
            home[l, e] = holders[np.argmin(homes[holders])]
    return home


def _redundant_slots(copies: np.ndarray, home: np.ndarray, width: int) -> np.ndarray:
    """Non-home copies of each GPU. copies [L, E, G], home [L, E] -> int32 [L, G, W] (-1 empty)."""
    extra = copies.copy()
    num_layers, num_experts, num_gpus = copies.shape
    extra[np.arange(num_layers)[:, None], np.arange(num_experts)[None, :], home] -= 1
    need = int(extra.sum(1).max(initial=0))
    out = np.full((num_layers, num_gpus, max(width, need)), -1, dtype=np.int32)
    for l, g in np.ndindex(num_layers, num_gpus):
        held = np.repeat(np.arange(num_experts), extra[l, :, g])
        out[l, g, : len(held)] = held
    return out


def history_weight(history: tuple[np.ndarray, ...], window: int, shape: tuple[int, int]) -> np.ndarray:
    """Moving average of the per-expert loads of the last ``window`` batches.

    history: loads [Mb', L, G, E] of earlier batches, oldest first -> float64 [L, E]. With no history
    every expert weighs 1 (no information yet).
    """
    recent = history[-window:] if window > 0 else ()
    if not recent:
        return np.ones(shape)
    return np.mean([np.asarray(h, dtype=np.float64).sum(axis=(0, 2)) for h in recent], axis=0)


@dataclass(frozen=True)
class EplbPlanner:
    """EPLB+ as a :class:`~relibra.planners.protocols.Planner`: replicate, pack, split tokens evenly over
    copies.

    ``redundant_slots`` (R) extra physical slots per GPU in every layer; ``policy`` hierarchical, global or
    auto (EPLB's rule); ``num_groups`` expert groups (0: one group per expert, i.e. no group-limited
    routing); ``load_mode`` oracle (this batch's loads) or history (moving average of the last
    ``history_window`` batches).
    """

    name: str = "eplb"
    redundant_slots: int = 2
    replica_slots: int = 0
    policy: Policy = "hierarchical"
    num_groups: int = 0
    load_mode: LoadMode = "oracle"
    history_window: int = 10

    def __post_init__(self) -> None:
        if self.redundant_slots < 0:
            raise ValueError(f"planner.redundant_slots={self.redundant_slots}; need >= 0")
        if self.replica_slots != 0:
            raise ValueError(
                f"planner.replica_slots={self.replica_slots}: EPLB has no per-layer replica buffer; use 0"
            )
        if self.policy not in ("hierarchical", "global", "auto"):
            raise ValueError(f"planner.policy={self.policy!r}; expected hierarchical, global or auto")
        if self.load_mode not in ("oracle", "history"):
            raise ValueError(f"planner.load_mode={self.load_mode!r}; expected oracle or history")
        if self.history_window < 1:
            raise ValueError(f"planner.history_window={self.history_window}; need >= 1")

    @property
    def replicas_in_home_node(self) -> bool:
        """Whether every extra copy stays in its expert's home node (hierarchical: replication per node)."""
        return self.policy == "hierarchical"

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    @property
    def history_batches(self) -> int:
        """Batches of past loads it reads: ``history_window`` in ``load_mode=history``, else none."""
        return self.history_window if self.load_mode == "history" else 0

    def weight(self, ctx: BatchContext) -> np.ndarray:
        """The loads EPLB balances: float64 [L, E] (oracle: this batch; history: moving average)."""
        num_layers, num_experts = ctx.counts.shape[1:]
        if self.load_mode == "oracle":
            return np.asarray(ctx.load, dtype=np.float64).sum(axis=(0, 2))
        return history_weight(ctx.history, self.history_window, (num_layers, num_experts))

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with home [L, E], redundant [L, G, R], assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        num_layers, num_experts = ctx.counts.shape[1:]
        g, nodes = ctx.num_gpus, ctx.cluster.num_domains
        if num_experts % g != 0:
            raise ValueError(f"E={num_experts} experts do not split evenly over G={g} GPUs")
        groups = self.num_groups or num_experts
        phy2log, _, logcnt = rebalance_experts(
            self.weight(ctx), num_experts + g * self.redundant_slots, groups, nodes, g, self.policy
        )
        copies = copies_per_gpu(phy2log, num_experts, g)  # [L, E, G]
        home = _choose_home(copies, num_experts // g)
        redundant = _redundant_slots(copies, home, self.redundant_slots)
        assign = even_split(np.asarray(ctx.load).sum(axis=2), copies[None])
        memory = num_layers * self.redundant_slots
        plan = BatchPlan(
            home=home,
            assign=assign,
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            redundant=redundant,
            stats={
                "redundant_experts_per_gpu": float(memory),
                "redundant_bytes_per_gpu": float(memory * ctx.cost.expert_weight_bytes()),
                "replicated_experts": float((logcnt > 1).sum()),
                "same_gpu_copies": float((copies > 1).sum()),
                "redundant_width": float(redundant.shape[-1]),
                "history_batches": float(min(len(ctx.history), self.history_window))
                if self.load_mode == "history"
                else 0.0,
            },
        )
        # NOTE: EPLB re-plans from scratch; among the equivalent relabellings keep experts where they are.
        plan = relabel_for(plan, ctx)
        return replace(plan, plan_time_s=time.perf_counter() - t0)
