"""UltraEP: per-micro-batch, per-layer replication inside the NVLink domain with per-copy token quotas.

Source: Dots-Infra/UltraEP v1.0.0 (MIT; arXiv 2606.04101), read and re-implemented, not copied:

* the quota placement solver ``quota_placement_solve_kernel`` of ``csrc/kernels/placement.cu`` (one CUDA
  block per NVLink domain) -> :func:`solve_domain`: the threshold search and ``warp_build_export_plan``
  (excess tokens of overloaded ranks exported, heaviest source rank first and its heaviest experts first,
  to the copy target with the most slack);
* the per-rank quota decomposition of the same kernel (``rank_quota_prefix``, locality-aware: each copy's
  host first keeps its own tokens, the rest is split over the copies' remaining room by largest remainder)
  -> :func:`split_sources`;
* ``dense_quota_reroute_scatter_kernel`` of ``csrc/kernels/reroute.cu``: a rank's tokens of an expert go
  to its copies by those per-rank prefixes (the interleave only permutes which tokens go, not how many), so
  ``assign[e, g]`` is the sum over source ranks of their allocations;
* the defaults of ``ultra_ep/config.py`` (``ULTRA_EP_BALANCE_THRESHOLD=1.0``, ``QUOTA_ORACLE_EPS=0.01``,
  ``QUOTA_MIN_TOKENS_PER_REPLICA=1024``, ``QUOTA_LOCALITY_AWARE=1``, ``QUOTA_ALLOW_ZERO_MASTER_QUOTA=0``);
* the placement: the framework's static one (master experts ``e // (E / G)``), ``replica_slots`` redundant
  slots per GPU shared by every layer (``num_local_redundant_experts``), filled per (micro-batch, layer).

The solver per NVLink domain (``cluster.nvl_domain`` GPUs, by default a node; UltraEP confines copies to it)
finds the smallest per-rank token threshold ``T`` for which the export plan is feasible: first up to three
"fast oracle" tries from ``ceil(lo * (1 + eps))`` in steps of ``ceil(hi / 100)`` with a dynamic minimum
copy size (``ceil(need / feasible targets)``), else a bisection on the capacity test (excess <= slack),
one try there with the fixed ``min_tokens_per_replica``, then a 4-probe search as the kernel's four warps
do it. Pricing (the simulator, :class:`~relibra.types.OnlineCopies`): planning on the critical path of
every (micro-batch, layer); the copies over NVLink twice on the critical path (forward ``weight_sync`` and
the backward restore before expert Dgrad); the replica gradients reduced home overlapping the backward
attention (``grad_reduce``). Choices the source leaves open: docs/online_baselines.md, "UltraEP".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from baselines.online import plan_every_microbatch
from relibra.planners.protocols import BatchContext, SlotBudget
from relibra.types import BatchPlan

__all__ = ["DomainSolution", "UltraEPPlanner", "solve_domain", "split_sources"]

UPSTREAM_CRITICAL_PATH_S = 117e-6
"""UltraEP's own figure per (micro-batch, layer) at EP 64 (README table, 256 experts, 8k tokens per rank,
worst column): ``update_placement`` 0.078 ms (load all-gather and solve) + ``reroute`` 0.039 ms."""

_FAST_RETRIES = 3
"""``QUOTA_ORACLE_FAST_MAX_RETRY + 1`` tries of the fast oracle."""
_PROBES = 4
"""Probes per round of the final search (``QUOTA_SOLVER_WARPS``: one per warp)."""


# ------------------------------------------------------------------------------------------ kernels
@njit(cache=True)
def _export_plan(
    loads: np.ndarray,
    rank_load: np.ndarray,
    source_order: np.ndarray,
    sorted_experts: np.ndarray,
    threshold: int,
    per_gpu: int,
    slots: int,
    min_tokens: int,
    allow_zero_master: bool,
    dynamic_floor: bool,
    out: np.ndarray,
    export_sum: np.ndarray,
) -> tuple[bool, int]:
    """``warp_build_export_plan`` at one threshold for one domain.

    loads int64 [Ed], rank_load int64 [Gd], source_order int64 [Gd], sorted_experts int64 [Gd, E/G];
    out int64 [Ed * Gd, 3] receives (expert, target rank, quota) rows; export_sum int64 [Ed] the tokens
    each expert exports. Returns (feasible, rows written).
    """
    g = rank_load.shape[0]
    excess = np.maximum(rank_load - threshold, 0)
    slack = np.maximum(threshold - rank_load, 0)
    used = np.zeros(g, np.int64)
    occ = np.zeros((loads.shape[0], g), np.bool_)
    for e in range(loads.shape[0]):
        occ[e, e // per_gpu] = True
        export_sum[e] = 0
    total_excess = excess.sum()
    running_slack = slack.sum()
    if total_excess == 0:
        return True, 0
    if total_excess > running_slack:
        return False, 0
    running_excess = total_excess
    n = 0
    for order in range(g):
        src = source_order[order]
        need = excess[src]
        if need <= 0:
            continue
        if need > running_slack:
            return False, n
        for pos in range(per_gpu):
            e = sorted_experts[src, pos]
            keep = 1 if (not allow_zero_master and loads[e] > 0) else 0
            avail = max(loads[e] - keep - export_sum[e], 0)
            while need > 0 and avail > 0:
                floor = min_tokens
                if dynamic_floor:
                    feasible = 0
                    for t in range(g):
                        if (
                            slack[t] > 0
                            and used[t] < slots
                            and not occ[e, t]
                            and min(need, slack[t], avail) > 0
                        ):
                            feasible += 1
                    if feasible == 0:
                        break
                    floor = max(1, (need + feasible - 1) // feasible)
                best, best_cap = -1, -1
                for t in range(g):
                    if slack[t] <= 0 or used[t] >= slots or occ[e, t]:
                        continue
                    if min(need, slack[t], avail) < floor:
                        continue
                    if slack[t] > best_cap:  # NOTE: strict, so ties keep the lowest rank, as the kernel.
                        best, best_cap = t, slack[t]
                if best < 0:
                    break
                q = min(need, slack[best], avail)
                out[n, 0], out[n, 1], out[n, 2] = e, best, q
                n += 1
                export_sum[e] += q
                slack[best] -= q
                used[best] += 1
                occ[e, best] = True
                running_excess -= q
                running_slack -= q
                need -= q
                avail -= q
            if need == 0:
                break
        if need > 0:
            return False, n
        if running_excess > running_slack:
            return False, n
    return True, n


@njit(cache=True)
def _capacity_feasible(rank_load: np.ndarray, threshold: int) -> bool:
    return np.maximum(rank_load - threshold, 0).sum() <= np.maximum(threshold - rank_load, 0).sum()


@njit(cache=True)
def _solve(
    loads: np.ndarray,
    per_gpu: int,
    slots: int,
    balance_threshold: float,
    oracle_eps: float,
    min_tokens: int,
    allow_zero_master: bool,
) -> tuple[np.ndarray, int, int, np.ndarray]:
    """``quota_placement_solve_kernel``'s search for one domain. loads int64 [Ed] ->
    (export rows int64 [n, 3], n, threshold, export_sum int64 [Ed])."""
    ed = loads.shape[0]
    g = ed // per_gpu
    rank_load = loads.reshape(g, per_gpu).sum(axis=1)
    # Source ranks heaviest first (ties: lower rank); each rank's experts heaviest first (ties: lower id).
    source_order = np.argsort(-rank_load, kind="mergesort")
    sorted_experts = np.empty((g, per_gpu), np.int64)
    for r in range(g):
        own = loads[r * per_gpu : (r + 1) * per_gpu]
        sorted_experts[r] = r * per_gpu + np.argsort(-own, kind="mergesort")
    out = np.zeros((ed * g + 1, 3), np.int64)
    export_sum = np.zeros(ed, np.int64)
    if slots == 0 or g <= 1:
        return out[:0], 0, int(rank_load.max()), export_sum
    # NOTE: float32 as in the kernel (ceilf of float arithmetic), so thresholds match to the token.
    bt = np.float32(max(balance_threshold, 1.0))
    lo = int(np.ceil(np.float32(rank_load.sum()) / np.float32(g) * bt))
    hi = max(int(rank_load.max()), lo)
    fast = max(int(np.ceil(np.float32(lo) * (np.float32(1.0) + np.float32(max(oracle_eps, 0.0))))), lo)
    step = max(1, (hi + 99) // 100)
    for _ in range(_FAST_RETRIES):
        ok, n = _export_plan(
            loads, rank_load, source_order, sorted_experts, fast, per_gpu, slots, min_tokens,
            allow_zero_master, True, out, export_sum,
        )  # fmt: skip
        if ok:
            return out[:n].copy(), n, fast, export_sum
        fast = min(hi, fast + step)
    top = hi
    while lo < hi:  # bisection on the capacity test alone
        probe = lo + (hi - lo) // 2
        if _capacity_feasible(rank_load, probe):
            hi = probe
        else:
            lo = probe + 1
    hi = top
    ok, n = _export_plan(
        loads, rank_load, source_order, sorted_experts, lo, per_gpu, slots, min_tokens,
        allow_zero_master, False, out, export_sum,
    )  # fmt: skip
    if ok:
        return out[:n].copy(), n, lo, export_sum
    lo = min(lo + 1, hi)
    while lo < hi:
        span = hi - lo
        small = span <= _PROBES
        first = -1
        probes = np.empty(_PROBES, np.int64)
        for w in range(_PROBES):
            probes[w] = lo + w if small else lo + (span * (w + 1)) // (_PROBES + 1)
            if first < 0 and (not small or probes[w] < hi):
                ok, _ = _export_plan(
                    loads, rank_load, source_order, sorted_experts, probes[w], per_gpu, slots,
                    min_tokens, allow_zero_master, False, out, export_sum,
                )  # fmt: skip
                if ok:
                    first = w
        if small:
            lo = probes[first] if first >= 0 else hi
            hi = lo
        elif first >= 0:
            hi = probes[first]
            if first > 0:
                lo = probes[first - 1] + 1
        else:
            lo = probes[_PROBES - 1] + 1
    ok, n = _export_plan(
        loads, rank_load, source_order, sorted_experts, lo, per_gpu, slots, min_tokens,
        allow_zero_master, False, out, export_sum,
    )  # fmt: skip
    return out[:n].copy(), n, lo, export_sum


@njit(cache=True)
def _instances(
    loads: np.ndarray, rows: np.ndarray, export_sum: np.ndarray, per_gpu: int, slots: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Copies of each expert from the export rows: (host int64 [Ed, Gd] (-1 unused), quota int64 [Ed, Gd],
    count int64 [Ed], slot table int64 [Gd, r] (domain-local expert per redundant slot, -1 empty)).
    Instance 0 is the master; replicas follow in export order; a target's slots fill in export order."""
    ed = loads.shape[0]
    g = ed // per_gpu
    host = np.full((ed, g), -1, np.int64)
    quota = np.zeros((ed, g), np.int64)
    count = np.ones(ed, np.int64)
    table = np.full((g, slots), -1, np.int64)
    next_slot = np.zeros(g, np.int64)
    for e in range(ed):
        host[e, 0] = e // per_gpu
        quota[e, 0] = loads[e] - export_sum[e]
    for i in range(rows.shape[0]):
        e, t, q = rows[i, 0], rows[i, 1], rows[i, 2]
        host[e, count[e]] = t
        quota[e, count[e]] = q
        count[e] += 1
        table[t, next_slot[t]] = e
        next_slot[t] += 1
    return host, quota, count, table


@njit(cache=True)
def _largest_remainder(total: int, weights: np.ndarray, eligible: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Split ``total`` tokens over weights [C] where eligible [C], by largest remainder; remainder ties go to
    the lower ``rank`` [C], then the lower index. Weights sum over eligible entries to the divisor."""
    c = weights.shape[0]
    out = np.zeros(c, np.int64)
    divisor = 0
    for j in range(c):
        divisor += weights[j]
    if total <= 0 or divisor <= 0:
        return out
    rem = np.full(c, -1, np.int64)
    assigned = 0
    for j in range(c):
        if eligible[j]:
            out[j] = (total * weights[j]) // divisor
            rem[j] = (total * weights[j]) % divisor
            assigned += out[j]
    for _ in range(total - assigned):
        best = -1
        for j in range(c):
            if not eligible[j]:
                continue
            if best < 0 or rem[j] > rem[best] or (rem[j] == rem[best] and rank[j] < rank[best]):
                best = j
        out[best] += 1
        rem[best] = -1
    return out


@njit(cache=True)
def _split(
    x: np.ndarray, start: int, host: np.ndarray, quota: np.ndarray, count: np.ndarray, locality: bool
) -> np.ndarray:
    """Per-source allocation of the domain's experts over their copies (``rank_quota_prefix``).

    x int64 [G, Ed]: tokens of every source rank of the EP group for the domain's experts; ``start`` the
    domain's first global rank; host/quota/count from :func:`_instances`. -> alloc int64 [G, Ed, Gd].
    """
    g_all, ed = x.shape
    gd = host.shape[1]
    alloc = np.zeros((g_all, ed, gd), np.int64)
    for e in range(ed):
        c = count[e]
        ranks = host[e, :c] + start
        q = quota[e, :c]
        if not locality:
            for j in range(g_all):
                alloc[j, e, :c] = _largest_remainder(x[j, e], q, np.ones(c, np.bool_), np.arange(c))
            continue
        # Each copy's host keeps its own tokens first (up to the copy's quota) ...
        fill = np.zeros(c, np.int64)
        for i in range(c):
            fill[i] = min(x[ranks[i], e], q[i])
        room = q - fill
        # ... and every rank's other tokens go to the other copies' remaining room.
        for j in range(g_all):
            mine = x[j, e]
            eligible = room > 0
            for i in range(c):
                if ranks[i] == j:
                    alloc[j, e, i] += fill[i]
                    mine -= fill[i]
                    eligible[i] = False
            if mine > 0:
                alloc[j, e, :c] += _largest_remainder(mine, room * eligible, eligible, ranks)
    return alloc


@njit(cache=True)
def _plan_layer(
    x: np.ndarray,
    gpus_per_node: int,
    slots: int,
    balance_threshold: float,
    oracle_eps: float,
    min_tokens: int,
    allow_zero_master: bool,
    locality: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (micro-batch, layer): x int64 [G, E] -> (assign int64 [E, G], replicas int32 [G, r],
    threshold int64 [N] per domain)."""
    g, num_experts = x.shape
    per_gpu = num_experts // g
    nodes = g // gpus_per_node
    ed = per_gpu * gpus_per_node
    assign = np.zeros((num_experts, g), np.int64)
    replicas = np.full((g, slots), -1, np.int32)
    thresholds = np.zeros(nodes, np.int64)
    for d in range(nodes):
        e0, r0 = d * ed, d * gpus_per_node
        xd = x[:, e0 : e0 + ed]
        loads = xd.sum(axis=0)
        rows, _, thr, export_sum = _solve(loads, per_gpu, slots, balance_threshold, oracle_eps, min_tokens,
                                          allow_zero_master)  # fmt: skip
        thresholds[d] = thr
        host, quota, count, table = _instances(loads, rows, export_sum, per_gpu, slots)
        alloc = _split(xd, r0, host, quota, count, locality)  # [G, Ed, Gd]
        per_copy = alloc.sum(axis=0)  # [Ed, Gd]
        for e in range(ed):
            for i in range(count[e]):
                assign[e0 + e, r0 + host[e, i]] += per_copy[e, i]
        for t in range(gpus_per_node):
            for s in range(slots):
                if table[t, s] >= 0:
                    replicas[r0 + t, s] = e0 + table[t, s]
    return assign, replicas, thresholds


# ---------------------------------------------------------------------------------------- public API
@dataclass(frozen=True)
class DomainSolution:
    """The solver's answer for one NVLink domain (for tests and inspection)."""

    threshold: int
    """The per-rank token threshold the search settled on."""
    host: np.ndarray
    """int64 [Ed, C]: domain-local rank of each copy of each expert (column 0 the master; -1 unused)."""
    quota: np.ndarray
    """int64 [Ed, C]: tokens each copy is to compute (``logical_instance_quota``)."""
    slots: np.ndarray
    """int64 [Gd, r]: domain-local expert in each redundant slot of each rank (-1 empty)."""


def solve_domain(
    loads: np.ndarray,
    experts_per_gpu: int,
    replica_slots: int,
    *,
    balance_threshold: float = 1.0,
    oracle_eps: float = 0.01,
    min_tokens_per_replica: int = 1024,
    allow_zero_master_quota: bool = False,
) -> DomainSolution:
    """UltraEP's placement and quota solve for one domain: loads int [Ed] (the domain's experts, master
    rank ``e // experts_per_gpu``) -> :class:`DomainSolution`."""
    loads = np.ascontiguousarray(loads, dtype=np.int64)
    rows, _, thr, export_sum = _solve(
        loads, experts_per_gpu, replica_slots, balance_threshold, oracle_eps, min_tokens_per_replica,
        allow_zero_master_quota,
    )  # fmt: skip
    host, quota, _, table = _instances(loads, rows, export_sum, experts_per_gpu, replica_slots)
    return DomainSolution(threshold=int(thr), host=host, quota=quota, slots=table)


def split_sources(
    x: np.ndarray, solution: DomainSolution, *, first_rank: int = 0, locality: bool = True
) -> np.ndarray:
    """Per-source token allocation over each expert's copies: x int [G, Ed] tokens of every source rank for
    the domain's experts -> int64 [G, Ed, C] (columns as ``solution.host``)."""
    count = (solution.host >= 0).sum(axis=1).astype(np.int64)
    return _split(
        np.ascontiguousarray(x, dtype=np.int64), first_rank, solution.host, solution.quota, count, locality
    )


@dataclass(frozen=True)
class UltraEPPlanner:
    """UltraEP as a :class:`~relibra.planners.protocols.Planner`: static placement, per-(micro-batch, layer)
    copies.

    ``replica_slots`` redundant slots per GPU shared by all layers (``num_local_redundant_experts``);
    ``balance_threshold``, ``oracle_eps``, ``min_tokens_per_replica``, ``allow_zero_master_quota``,
    ``locality_aware``: UltraEP's ``ULTRA_EP_*`` knobs with their defaults. ``critical_path_s``: planning
    seconds charged per (micro-batch, layer); None charges this implementation's measured time instead.
    """

    name: str = "ultraep"
    replica_slots: int = 2
    redundant_slots: int = 0
    balance_threshold: float = 1.0
    oracle_eps: float = 0.01
    min_tokens_per_replica: int = 1024
    allow_zero_master_quota: bool = False
    locality_aware: bool = True
    critical_path_s: float | None = UPSTREAM_CRITICAL_PATH_S

    replicas_in_home_node = True
    """Copies stay in the NVLink domain (here: the expert's home node)."""

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    def __post_init__(self) -> None:
        if self.replica_slots < 0:
            raise ValueError(f"planner.replica_slots={self.replica_slots}; need >= 0")
        if self.redundant_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}: UltraEP's slots are per layer; use "
                "planner.replica_slots"
            )
        if self.balance_threshold < 1.0:
            raise ValueError(f"planner.balance_threshold={self.balance_threshold}; need >= 1.0")
        if self.oracle_eps < 0.0:
            raise ValueError(f"planner.oracle_eps={self.oracle_eps}; need >= 0")
        if self.min_tokens_per_replica < 1:
            raise ValueError(f"planner.min_tokens_per_replica={self.min_tokens_per_replica}; need >= 1")
        if self.critical_path_s is not None and self.critical_path_s < 0:
            raise ValueError(f"planner.critical_path_s={self.critical_path_s}; need >= 0 or null (measured)")

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with replicas [Mb, L, G, r], assign [Mb, L, E, G] and the
        critical-path record (:class:`~relibra.types.OnlineCopies`)."""
        t0 = time.perf_counter()
        args = (ctx.cluster.domain_gpus, self.replica_slots, self.balance_threshold, self.oracle_eps,
                self.min_tokens_per_replica, self.allow_zero_master_quota, self.locality_aware)  # fmt: skip

        def kernel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            a, rep, _ = _plan_layer(x, *args)
            return a, rep

        return plan_every_microbatch(ctx, kernel, self.replica_slots, self.critical_path_s, "ultraep", t0)
