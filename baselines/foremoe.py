"""ForeMoE: micro-step-level load balancing from routing replay, with a hierarchical planner and a transfer
engine of two paths (arXiv 2606.11867, Zhou et al., June 2026; no public code).

What could be read of the paper (docs/baselines.md, "ForeMoE", lists the sources and what each held): its
abstract, the first paragraph of its introduction, and the opening of a third-party technical review. Its
method sections, equations, algorithm boxes and evaluation settings could not be read, so no function
below cites a section or an equation; each names the sentence it follows, and every algorithmic detail is
this suite's choice (listed in docs/baselines.md):

* [A1] abstract, "uses foreseeable routing information from the rollout stage to proactively guide load
  balancing in the remaining stages" and [R] the review: the routing of every gradient-accumulation
  micro-step of the recompute and policy-update stages is known before they run, while the step-level load
  is stable. Here: the oracle loads ``x[m, l, j, e]`` of each micro-batch (ReLibra's), the static placement
  kept for the step, one plan per (micro-batch, layer) before the step (:meth:`ForeMoEPlanner.plan`);
* [A2] abstract, "a hierarchical planner that decomposes the NP-hard load balancing problem into tractable
  sub-components" for "frequent per-micro-step reconfiguration". Here (the decomposition is ours): level 1
  evens the NVLink domains' tokens with copies of hot experts in other domains (:func:`_balance_domains`),
  level 2 evens the GPUs of each domain with copies inside it (:func:`_balance_gpus`); both greedy moves of
  tokens from the most to the least loaded unit, bounded by ``replica_slots`` copies per GPU per layer;
* [A3] abstract, "a transfer engine that leverages complementary hardware paths (CPU-assisted and
  GPU-direct) for overlapped expert transfer". Here (path rule and overlap ours): each copy is read over
  the faster of the fabric from its home and the GPU's host link
  (``cluster.hardware.host_to_device_bytes_per_s``), both paths at once
  (:meth:`relibra.cost.model.CostModel.engine_copy_time`); planned ahead, the fill overlaps the layer's
  forward attention, and the copies' gradients return home over the fabric during the backward attention
  (:meth:`relibra.cost.model.CostModel.exposed_copies`), only the excess exposed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from relibra.cluster import ClusterSpec
from relibra.planners.protocols import BatchContext, SlotBudget, static_placement
from relibra.types import BatchPlan

__all__ = ["ForeMoEPlanner", "plan_layer"]


# ------------------------------------------------------------------------------------------ kernels
@njit(cache=True)
def _holds(replicas: np.ndarray, home: np.ndarray, e: int, g: int) -> bool:
    """GPU g computes expert e from its own weights or a copy. replicas int64 [G, r], home int64 [E]."""
    if home[e] == g:
        return True
    for s in range(replicas.shape[1]):
        if replicas[g, s] == e:
            return True
    return False


@njit(cache=True)
def _place(replicas: np.ndarray, home: np.ndarray, e: int, g: int) -> bool:
    """Make GPU g hold expert e (a free slot when it does not yet); False when it has no slot left."""
    if _holds(replicas, home, e, g):
        return True
    for s in range(replicas.shape[1]):
        if replicas[g, s] < 0:
            replicas[g, s] = e
            return True
    return False


@njit(cache=True)
def _release(replicas: np.ndarray, assign: np.ndarray, home: np.ndarray, e: int, g: int) -> None:
    """Free g's slot of expert e once g computes none of its tokens."""
    if assign[e, g] > 0 or home[e] == g:
        return
    for s in range(replicas.shape[1]):
        if replicas[g, s] == e:
            replicas[g, s] = -1


@njit(cache=True)
def _balance_domains(assign: np.ndarray, replicas: np.ndarray, home: np.ndarray, domain: int) -> int:
    """Level 1 of the hierarchical planner ([A2]; the rule is this suite's): move tokens from the most to
    the least loaded NVLink domain, the hottest expert of the sender (its tokens computed there) to the least
    loaded GPU of the receiver that holds it or has a slot, ``min(its tokens, sender excess, receiver
    deficit, the GPU's room below the busiest GPU)`` at a time (taken from the sender's busiest GPUs
    holding it), while the sender is above the mean and the receiver below it. The room keeps the busiest
    GPU's load from growing (level 2 then evens the receiving domain), so no GPU ends busier than the
    busiest one of the static placement. Returns the moves made.

    assign int64 [E, G] (updated), replicas int64 [G, r] (updated), home int64 [E]."""
    num_experts, g = assign.shape
    nd = g // domain
    total = assign.sum()
    moves = 0
    tried = np.zeros((num_experts, nd), np.bool_)
    for _ in range(4 * g * replicas.shape[1] + 4 * num_experts):
        per_gpu = assign.sum(axis=0)
        per_dom = per_gpu.reshape(nd, domain).sum(axis=1)
        hi, lo = int(np.argmax(per_dom)), int(np.argmin(per_dom))
        excess = per_dom[hi] - total // nd
        deficit = (total + nd - 1) // nd - per_dom[lo]
        if excess <= 0 or deficit <= 0 or hi == lo:
            break
        # The sender's hottest expert not yet tried for this receiver.
        best, best_tok = -1, 0
        for e in range(num_experts):
            if tried[e, lo]:
                continue
            tok = assign[e, hi * domain : (hi + 1) * domain].sum()
            if tok > best_tok:
                best, best_tok = e, tok
        if best < 0:
            break
        # The receiver's least loaded GPU that can compute it.
        target, target_load = -1, 0
        for t in range(lo * domain, (lo + 1) * domain):
            if _holds(replicas, home, best, t) or (replicas[t] < 0).any():
                if target < 0 or per_gpu[t] < target_load:
                    target, target_load = t, per_gpu[t]
        room = per_gpu.max() - target_load
        if target < 0 or room <= 0:
            tried[best, lo] = True
            continue
        take = min(best_tok, excess, deficit, room)
        _place(replicas, home, best, target)
        # Take from the sender's GPUs holding the expert, the busiest first.
        left = take
        while left > 0:
            src, src_load = -1, -1
            for s in range(hi * domain, (hi + 1) * domain):
                if assign[best, s] > 0 and per_gpu[s] > src_load:
                    src, src_load = s, per_gpu[s]
            part = min(left, assign[best, src])
            assign[best, src] -= part
            assign[best, target] += part
            per_gpu[src] -= part
            _release(replicas, assign, home, best, src)
            left -= part
        moves += 1
    return moves


@njit(cache=True)
def _balance_gpus(assign: np.ndarray, replicas: np.ndarray, home: np.ndarray, domain: int) -> int:
    """Level 2 of the hierarchical planner ([A2]; the rule is this suite's), in each NVLink domain: move
    tokens from its most to its least loaded GPU, the busiest GPU's hottest expert that the least loaded one
    holds or has a slot for, half their gap (at most the expert's tokens there) at a time, until the gap is
    one token or no expert can move. Returns the moves made.

    assign int64 [E, G] (updated), replicas int64 [G, r] (updated), home int64 [E]."""
    num_experts, g = assign.shape
    moves = 0
    for d in range(g // domain):
        lo_g, hi_g = d * domain, (d + 1) * domain
        for _ in range(4 * domain * replicas.shape[1] + 4 * num_experts):
            per_gpu = assign[:, lo_g:hi_g].sum(axis=0)
            hi = lo_g + int(np.argmax(per_gpu))
            lo = lo_g + int(np.argmin(per_gpu))
            gap = per_gpu[hi - lo_g] - per_gpu[lo - lo_g]
            if gap <= 1:
                break
            best, best_tok = -1, 0
            for e in range(num_experts):
                tok = assign[e, hi]
                if tok > best_tok and (_holds(replicas, home, e, lo) or (replicas[lo] < 0).any()):
                    best, best_tok = e, tok
            if best < 0:
                break
            take = min(best_tok, gap // 2)
            _place(replicas, home, best, lo)
            assign[best, hi] -= take
            assign[best, lo] += take
            _release(replicas, assign, home, best, hi)
            moves += 1
    return moves


@njit(cache=True)
def _plan_layer(
    x: np.ndarray, home: np.ndarray, domain: int, slots: int
) -> tuple[np.ndarray, np.ndarray, int, int]:
    """One (micro-batch, layer), one micro-step's reconfiguration ([A2]): every expert's tokens at home,
    then level 1 (only when the EP group spans several NVLink domains), then level 2.

    x int64 [G, E], home int64 [E] -> (assign int64 [E, G], replicas int32 [G, slots], level-1 moves,
    level-2 moves)."""
    g, num_experts = x.shape
    count = x.sum(axis=0)
    assign = np.zeros((num_experts, g), np.int64)
    for e in range(num_experts):
        assign[e, home[e]] = count[e]
    replicas = np.full((g, slots), -1, np.int64)
    m1 = _balance_domains(assign, replicas, home, domain) if g > domain and slots > 0 else 0
    m2 = _balance_gpus(assign, replicas, home, domain) if slots > 0 else 0
    return assign, replicas.astype(np.int32), m1, m2


# ---------------------------------------------------------------------------------------- public API
def plan_layer(
    x: np.ndarray, home: np.ndarray, domain_gpus: int, replica_slots: int
) -> tuple[np.ndarray, np.ndarray]:
    """ForeMoE's two levels for one (micro-batch, layer): x int [G, E] (oracle loads), home int [E] ->
    (assign int64 [E, G], replicas int32 [G, replica_slots], -1 empty)."""
    a, rep, _, _ = _plan_layer(
        np.ascontiguousarray(x, dtype=np.int64),
        np.ascontiguousarray(home, np.int64),
        domain_gpus,
        replica_slots,
    )
    return a, rep


@dataclass(frozen=True)
class ForeMoEPlanner:
    """ForeMoE as a :class:`~relibra.planners.protocols.Planner` ([A1]-[A3]): static placement; per
    (micro-batch, layer) copies planned from the replayed loads, across NVLink domains (level 1) and inside
    them (level 2), fetched by the two-path transfer engine behind attention.

    ``replica_slots``: copies per GPU per layer, in a buffer shared by all layers (as ReLibra's).
    """

    name: str = "foremoe"
    replica_slots: int = 2
    redundant_slots: int = 0

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, replicas_in_home_node=False)

    def __post_init__(self) -> None:
        if self.replica_slots < 0:
            raise ValueError(f"planner.replica_slots={self.replica_slots}; need >= 0")
        if self.redundant_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}: ForeMoE's copies are per micro-step; use "
                "planner.replica_slots"
            )

    def cluster_problems(self, num_experts: int, cluster: ClusterSpec) -> list[str]:
        """The transfer engine's CPU-assisted path needs the host link's rate."""
        if cluster.hardware.host_to_device_bytes_per_s <= 0:
            return [
                f"cluster.hardware.host_to_device_bytes_per_s={cluster.hardware.host_to_device_bytes_per_s}: "
                "ForeMoE's transfer "
                "engine reads expert weights from host memory too; give the host link's rate (bytes/s)"
            ]
        return []

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """[A1]: ctx.load [Mb, L, G, E] (the replayed loads of the step's micro-batches) -> BatchPlan with
        replicas [Mb, L, G, r], assign [Mb, L, E, G], ``host_path`` set ([A3]: the transfer engine prices
        the fills, the fabric the gradients' return)."""
        problems = self.cluster_problems(ctx.model.num_experts, ctx.cluster)
        if problems:
            raise ValueError("; ".join(problems))
        t0 = time.perf_counter()
        mb, num_layers, g, num_experts = ctx.load.shape
        home = static_placement(num_layers, num_experts, g)
        domain = ctx.cluster.domain_gpus
        assign = np.zeros((mb, num_layers, num_experts, g), np.int32)
        replicas = np.full((mb, num_layers, g, self.replica_slots), -1, np.int32)
        moves = np.zeros((2, mb, num_layers))
        x = np.asarray(ctx.load, dtype=np.int64)
        h = home.astype(np.int64)
        for m in range(mb):
            for layer in range(num_layers):
                a, rep, m1, m2 = _plan_layer(x[m, layer], h[layer], domain, self.replica_slots)
                assign[m, layer], replicas[m, layer] = a, rep
                moves[:, m, layer] = (m1, m2)
        copies = (replicas >= 0).sum(axis=-1)
        src = home[np.arange(num_layers)[None, :, None, None], np.maximum(replicas, 0)]  # [Mb, L, G, r]
        cross = (replicas >= 0) & (src // domain != np.arange(g)[None, None, :, None] // domain)
        stats = {
            "foremoe_domain_moves_per_layer": float(moves[0].mean()),
            "foremoe_gpu_moves_per_layer": float(moves[1].mean()),
            "foremoe_cross_domain_copies_per_layer": float(cross.sum(axis=(-1, -2)).mean()),
            "replicas_mean": float(copies.mean()),
            "reorder_moved_experts": 0.0,
        }
        return BatchPlan(
            home=home,
            assign=assign,
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            replicas=replicas,
            plan_time_s=time.perf_counter() - t0,
            stats=stats,
            host_path=True,
        )
