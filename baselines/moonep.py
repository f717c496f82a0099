"""MoonEP: per micro-batch and layer, redundant experts planned from the router's output so that every GPU
of an NVLink domain computes the same number of tokens.

Source: the MoonEP planning algorithm (MoonshotAI/MoonEP, read in its public fork zhumakhan/MoonEP, whose
snapshot carries no license file; the algorithm is re-implemented here from its description, not copied):
the torch reference of the planning kernel (``tests/planning_reference.py``) and the README's contract
(every rank receives ``floor(total * K / R)`` routed slots, one more for the first ``total * K mod R``
ranks; ``epn = E / R`` prefetch slots per rank shared by every layer; prefetch before the expert GEMMs, the
copies' gradients reduced home in the backward). Megatron-core main's virtual-expert load balancer
(NVIDIA/Megatron-LM ``megatron/core/transformer/moe/virtual_expert_load_balancer.py`` and
``virtual_expert_triton.py: _plan_virtual_expert_placement_kernel``, BSD-3-Clause, "taken from MoonEP")
decides the same: the same two greedy passes with the same tie rules, so it is no planner of its own
(docs/online_baselines.md, "MoonEP and Megatron-core's virtual-expert balancer").

Vocabulary (upstream's): a *home group* is the ``epn`` experts a rank owns (master ``e // epn``);
``balance[r]`` the tokens of ``r``'s home group over its receive cap; ``z[h, u]`` the quota home group ``h``
sends to receiver ``u``; ``alloc[e, d]`` the tokens of expert ``e`` computed on rank ``d``.

1. :func:`receive_quotas` (the "choose remote receivers" loop): pair the most overloaded home group with the
   roomiest rank and give that rank its whole deficit from that one sender (ties: the lowest rank), until no
   group is over its cap. A sender may send more than its excess and receive later; every receiver has one
   sender, so it never needs more than ``epn`` slots.
2. :func:`allocate` (the per-group quota split): each group serves its largest remaining quota from its
   expert with the most remaining tokens (ties: the lowest expert), ``min(quota, remaining)`` at a time.
3. :func:`slot_experts`: each rank's remote experts with tokens, most tokens first (ties: the highest
   expert), fill its prefetch slots.

Pricing (the simulator, :class:`~relibra.types.OnlineCopies`): planning on the critical path of every
(micro-batch, layer), this implementation's measured time (:data:`MEASURED_CRITICAL_PATH_S`; upstream
publishes no figure); the copies twice in full (the forward ``prefetch_weight`` after dispatch, and the
backward's re-push before the expert GEMMs: the slots are shared by all layers); the gradient reduction home
overlapping the backward attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from baselines.online import plan_every_microbatch
from relibra.cluster import ClusterSpec
from relibra.planners.protocols import BatchContext, SlotBudget
from relibra.types import BatchPlan

__all__ = ["MEASURED_CRITICAL_PATH_S", "MoonEPPlanner", "allocate", "receive_caps", "receive_quotas"]

MEASURED_CRITICAL_PATH_S = 93e-6
"""This implementation's median planning time per (micro-batch, layer) at EP 64 in one NVLink domain (128
experts, 8192 tokens x top-8 per GPU, 200 skewed draws; compiled, one core of a shared 2-core machine;
docs/records/baselines.md, "MoonEP planning"). Upstream plans in one cooperative GPU launch after an
all-gather of the per-rank histograms and publishes no time."""


# ------------------------------------------------------------------------------------------ kernels
@njit(cache=True)
def _receive_quotas(balance: np.ndarray) -> np.ndarray:
    """Step 1. balance int64 [R] (tokens over the cap; sums to 0) -> z int64 [R(h), R(u)]."""
    b = balance.copy()
    r = b.shape[0]
    z = np.zeros((r, r), np.int64)
    for _ in range(r):  # NOTE: each round zeroes one receiver for good, so R rounds always suffice.
        h = int(np.argmax(b))
        if b[h] <= 0:
            break
        u = int(np.argmin(b))
        move = -b[u]
        z[h, u] += move
        b[h] -= move
        b[u] = 0
    return z


@njit(cache=True)
def _allocate(expert_count: np.ndarray, z: np.ndarray, epn: int) -> np.ndarray:
    """Step 2. expert_count int64 [Ed], z int64 [R, R] -> alloc int64 [Ed, R]."""
    ed = expert_count.shape[0]
    r = z.shape[0]
    alloc = np.zeros((ed, r), np.int64)
    for e in range(ed):
        alloc[e, e // epn] = expert_count[e]
    for h in range(r):
        remaining = expert_count[h * epn : (h + 1) * epn].copy()
        quotas = z[h].copy()
        for _ in range(r + epn):  # NOTE: each step exhausts a quota or an expert.
            d = int(np.argmax(quotas))
            if quotas[d] <= 0:
                break
            local = int(np.argmax(remaining))
            take = min(remaining[local], quotas[d])
            e = h * epn + local
            alloc[e, d] += take
            alloc[e, h] -= take
            remaining[local] -= take
            quotas[d] -= take
    return alloc


@njit(cache=True)
def _plan_layer(x: np.ndarray, domain: int, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """One (micro-batch, layer): x int64 [G, E] -> (assign int64 [E, G], replicas int32 [G, slots]).

    Each NVLink domain of ``domain`` GPUs balances the tokens of its own experts over its own GPUs."""
    g, num_experts = x.shape
    epn = num_experts // g
    ed = epn * domain
    assign = np.zeros((num_experts, g), np.int64)
    replicas = np.full((g, slots), -1, np.int32)
    for d in range(g // domain):
        e0, r0 = d * ed, d * domain
        count = x[:, e0 : e0 + ed].sum(axis=0)
        total = count.sum()
        cap = np.full(domain, total // domain, np.int64)
        cap[: total % domain] += 1
        group = count.reshape(domain, epn).sum(axis=1)
        alloc = _allocate(count, _receive_quotas(group - cap), epn)
        assign[e0 : e0 + ed, r0 : r0 + domain] = alloc
        for t in range(domain):
            remote = np.empty(ed, np.int64)
            n = 0
            for e in range(ed):
                if alloc[e, t] > 0 and e // epn != t:
                    remote[n] = e
                    n += 1
            # Most tokens first; ties: the highest expert (both upstreams' slot order).
            keys = -(alloc[remote[:n], t] * (ed + 1) + remote[:n])
            order = remote[:n][np.argsort(keys, kind="mergesort")]
            for s in range(min(n, slots)):
                replicas[r0 + t, s] = e0 + order[s]
            if n > slots:
                raise ValueError("MoonEP needs more prefetch slots than planner.replica_slots")
    return assign, replicas


# ---------------------------------------------------------------------------------------- public API
def receive_caps(total: int, ranks: int) -> np.ndarray:
    """Tokens each of ``ranks`` ranks receives of ``total``: ``total // R``, one more for the first
    ``total % R`` ranks. -> int64 [R]."""
    cap = np.full(ranks, total // ranks, np.int64)
    cap[: total % ranks] += 1
    return cap


def receive_quotas(balance: np.ndarray) -> np.ndarray:
    """Step 1 (:mod:`baselines.moonep`): balance int [R] -> quotas z int64 [R(sender), R(receiver)]."""
    b = np.ascontiguousarray(balance, dtype=np.int64)
    if b.sum() != 0:
        raise ValueError(f"balance sums to {int(b.sum())}; the caps must split the tokens exactly")
    return _receive_quotas(b)


def allocate(expert_count: np.ndarray, quotas: np.ndarray, experts_per_gpu: int) -> np.ndarray:
    """Step 2: expert_count int [E], quotas int [R, R] -> alloc int64 [E, R] (tokens of e on rank d)."""
    return _allocate(
        np.ascontiguousarray(expert_count, dtype=np.int64),
        np.ascontiguousarray(quotas, np.int64),
        experts_per_gpu,
    )


@dataclass(frozen=True)
class MoonEPPlanner:
    """MoonEP as a :class:`~relibra.planners.protocols.Planner`: static placement, per-(micro-batch, layer)
    redundant experts inside each NVLink domain.

    ``replica_slots``: prefetch slots per GPU, shared by every layer; upstream sizes them at ``E / G``
    (``epn``), which its single-sender rule never exceeds, so any value >= ``E / G`` plans the same and a
    smaller one is refused before any work. ``critical_path_s``: planning seconds charged per (micro-batch,
    layer) (default :data:`MEASURED_CRITICAL_PATH_S`); None charges the time measured in the run.
    """

    name: str = "moonep"
    replica_slots: int = 16
    redundant_slots: int = 0
    critical_path_s: float | None = MEASURED_CRITICAL_PATH_S

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, replicas_in_home_node=True)

    def __post_init__(self) -> None:
        if self.replica_slots < 1:
            raise ValueError(
                f"planner.replica_slots={self.replica_slots}; need >= 1 (MoonEP's prefetch slots)"
            )
        if self.redundant_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}: MoonEP's slots are shared by all layers; "
                "use planner.replica_slots"
            )
        if self.critical_path_s is not None and self.critical_path_s < 0:
            raise ValueError(f"planner.critical_path_s={self.critical_path_s}; need >= 0 or null (measured)")

    def cluster_problems(self, num_experts: int, cluster: ClusterSpec) -> list[str]:
        """MoonEP's single-sender rule may fill all ``E / G`` slots of a GPU."""
        g = cluster.num_gpus
        if self.replica_slots < num_experts // g:
            return [
                f"planner.replica_slots={self.replica_slots} is below model.num_experts / G = "
                f"{num_experts} / {g} = {num_experts // g}, the prefetch slots MoonEP may fill on one GPU"
            ]
        return []

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with replicas [Mb, L, G, r], assign [Mb, L, E, G] and the
        critical-path record (:class:`~relibra.types.OnlineCopies`)."""
        t0 = time.perf_counter()
        problems = self.cluster_problems(ctx.load.shape[-1], ctx.cluster)
        if problems:
            raise ValueError("; ".join(problems))
        domain = ctx.cluster.domain_gpus

        def kernel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _plan_layer(x, domain, self.replica_slots)

        return plan_every_microbatch(ctx, kernel, self.replica_slots, self.critical_path_s, "moonep", t0)
