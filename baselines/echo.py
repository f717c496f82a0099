"""ECHO, Elastic Cloning for Hot Experts: per micro-batch and layer, after routing, overloaded experts are
cloned into spare ("echo") slots of under-loaded GPUs anywhere in the EP group and their overflow tokens
redirected there; the clones' weight gradients are reduced home in the backward pass.

Source: NVIDIA/Megatron-LM pull request #2368 ("MoE ECHO", ``moe_enable_echo``; BSD-3-Clause), read at its
head a2b16b8 (2026-01-15) and re-implemented here, not copied. The stored Megatron-LM main (2026-08-22)
holds no ECHO code; the paper arXiv 2603.07685 (Megatron Core's MoE report) could be read only as far as
its abstract. docs/online_baselines.md, "ECHO", maps every function to its source:

* ``gen_intermediate`` (``megatron/core/transformer/moe/offloading_planner.py``) -> :func:`spill_and_spare`:
  the average ``avg = total // G`` is each rank's capacity; a rank below it offers ``avg - load`` spare
  tokens; each rank above it keeps its experts from the least to the most loaded until ``avg`` is reached,
  and the tokens past ``avg`` are each expert's *spill*;
* ``gen_assignment_for_approx_bp`` and ``approx_bin_packing_kernel`` (one echo slot per rank) ->
  :func:`_approx_bin_packing`: spills and spare ranks in decreasing order; spills put in 8 buckets by size
  (bucket 0 at least ``avg``, then steps of ``avg // 7``); each spare rank, roomiest first, takes the head of
  the first non-empty bucket from the last one used, ``min(spill left, room)`` tokens, and a part-placed
  expert goes back to the tail of the bucket its remainder falls in;
* ``gen_assignment`` and ``one_shot_greedy_assignment`` (two or more slots per rank) ->
  :func:`_one_shot_greedy`: the sorted spills laid end to end against the sorted spare capacities laid end to
  end; each spare rank keeps the ``slots`` largest overlaps with it (``topk``), the rest stays home;
* ``echo_forward`` (``moe_layer.py``): the bin-packing path when ``moe_num_echo_experts // EP`` is 1, the
  one-shot greedy one otherwise; ``threshold_multiplier`` left at its default 0 (``reclaim_spare_experts``
  is never reached from ``moe_layer.py``);
* ``HybridEPExpertDispatch`` (``fused_a2a.py``): each clone's weights are dispatched from the expert's home
  rank after routing, before the token dispatch; the backward combines the clones' weight gradients and
  adds them to the home expert's ``main_grad``.

Pricing (the simulator, :class:`~relibra.types.OnlineCopies`, the terms of UltraEP and LLEP): planning on
the critical path of every (micro-batch, layer) (:data:`MEASURED_CRITICAL_PATH_S`; upstream publishes no
figure); the clones' weights over the fabric from their homes (NVLink in the node, the rail NICs across
nodes) in full after routing, and their gradients home in full in the backward (the dispatch and its
backward combine sit on the compute stream; ``moe_echo_expert_dispatch_overlap`` is off by default), plus a
third pass when ``recompute_expert_dispatch`` re-dispatches the weights in the backward
(``moe_echo_recompute_expert_dispatch``).

Choices the source leaves open, and the ones made here (docs/online_baselines.md, "ECHO", gives the reasons):

* echo slots per GPU: ``replica_slots`` 2, the suite's slot count for UltraEP, ForeMoE and ReLibra
  (upstream's config requires ``moe_num_echo_experts`` and sets no default);
* ties: stable orders everywhere (equal loads kept home lowest expert first; equal spills and spares lowest
  id first; equal overlaps in ``topk`` the larger spill first); upstream's ``torch.sort`` and ``topk`` leave
  them unspecified;
* the bucket width when ``avg < 7``: 1 token (upstream divides by ``avg // 7``, zero there);
* each source's share of a clone: the proportional split rule shared by the cost model (upstream's
  breadth-first pass up to its rounding; the per-clone totals are upstream's exactly);
* memory: each layer's clones are held from forward to backward, ``L x r`` experts per GPU; the memory
  check and ``replica_buffer_bytes`` count ``r``, as for UltraEP;
* the planning time charged (:data:`MEASURED_CRITICAL_PATH_S`): upstream publishes none;
* the EP group: any size, the average over the whole group, clones across nodes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from baselines.online import plan_every_microbatch
from relibra.cluster import ClusterSpec
from relibra.planners.protocols import BatchContext, SlotBudget
from relibra.types import BatchPlan

__all__ = ["MEASURED_CRITICAL_PATH_S", "EchoLayerPlan", "EchoPlanner", "offload_plan", "spill_and_spare"]

MEASURED_CRITICAL_PATH_S = 65e-6
"""Planning seconds charged per (micro-batch, layer): LLEP's charged median (50 us, :mod:`baselines.llep`)
times the median ratio of this implementation's median to LLEP's, both measured in the same three runs of
``benchmarks/bench_online.py`` (EP 64, Qwen3-235B-A22B shapes, one quick-scale mixed batch; compiled, one
core of a shared 2-core machine under load): 130/99, 139/114, 188/101 us, ratio 1.31
(docs/online_baselines.md, "ECHO"). Upstream plans on the GPU (``torch.compile`` and one Triton block)
after an all-gather of the per-rank counts and publishes no time."""

NUM_BUCKETS = 8
"""Buckets of the approximate bin packing (``gen_assignment_for_approx_bp``'s default ``num_buckets``)."""


# ------------------------------------------------------------------------------------------ kernels
@njit(cache=True)
def _spill_and_spare(counts: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``gen_intermediate``. counts int64 [E] (expert ``e`` at home on GPU ``e // (E / G)``) ->
    (spill int64 [E], spare int64 [G], avg)."""
    num_experts = counts.shape[0]
    per_gpu = num_experts // num_gpus
    rank_load = np.zeros(num_gpus, np.int64)
    for r in range(num_gpus):
        rank_load[r] = counts[r * per_gpu : (r + 1) * per_gpu].sum()
    avg = rank_load.sum() // num_gpus
    spare = np.maximum(avg - rank_load, 0)
    spill = np.zeros(num_experts, np.int64)
    for r in range(num_gpus):
        own = counts[r * per_gpu : (r + 1) * per_gpu]
        # NOTE: least loaded first, ties to the lower expert (stable; upstream's torch.sort leaves ties open).
        order = np.argsort(own, kind="mergesort")
        cum, before = 0, 0
        for i in order:
            cum += own[i]
            over = max(cum - avg, 0)
            spill[r * per_gpu + i] = over - before
            before = over
    return spill, spare, avg


@njit(cache=True)
def _bucket(value: int, avg: int, interval: int, num_buckets: int) -> int:
    """Bucket of a spill: 0 at ``avg`` or more, else ``(avg - value) // interval + 1`` clamped to the last."""
    if value >= avg:
        return 0
    return min(max((avg - value) // interval + 1, 0), num_buckets - 1)


@njit(cache=True)
def _approx_bin_packing(
    spill: np.ndarray, spare: np.ndarray, avg: int, num_buckets: int
) -> tuple[np.ndarray, np.ndarray]:
    """``approx_bin_packing_kernel`` (one echo slot per rank). spill int64 [E], spare int64 [G] ->
    (slot expert int64 [G, 1] (-1 empty), slot tokens int64 [G, 1])."""
    num_experts, g = spill.shape[0], spare.shape[0]
    slot_expert = np.full((g, 1), -1, np.int64)
    slot_tokens = np.zeros((g, 1), np.int64)
    # NOTE: upstream divides by avg // (num_buckets - 1), zero when avg < num_buckets - 1; 1 here.
    interval = max(avg // (num_buckets - 1), 1) if num_buckets > 1 else max(avg, 1)
    experts = np.argsort(-spill, kind="mergesort")  # most spill first, ties to the lower expert
    ranks = np.argsort(-spare, kind="mergesort")  # most room first, ties to the lower rank
    remaining = spill.copy()
    items = np.full((num_buckets, num_experts + g), -1, np.int64)
    head = np.zeros(num_buckets, np.int64)
    tail = np.zeros(num_buckets, np.int64)
    for e in experts:
        if spill[e] > 0:
            b = _bucket(spill[e], avg, interval, num_buckets)
            items[b, tail[b]] = e
            tail[b] += 1
    current = 0
    for r in ranks:
        room = spare[r]
        if room <= 0:
            break
        found = -1
        start = current
        for b in range(start, num_buckets):
            if found >= 0:
                break
            if head[b] < tail[b]:
                candidate = items[b, head[b]]
                head[b] += 1
                if remaining[candidate] > 0:
                    found, current = candidate, b
            else:
                current = b + 1
        if found < 0:
            break
        put = min(remaining[found], room)
        slot_expert[r, 0], slot_tokens[r, 0] = found, put
        remaining[found] -= put
        if remaining[found] > 0:
            b = _bucket(remaining[found], avg, interval, num_buckets)
            items[b, tail[b]] = found
            tail[b] += 1
    return slot_expert, slot_tokens


@njit(cache=True)
def _one_shot_greedy(spill: np.ndarray, spare: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``gen_assignment`` with ``one_shot_greedy_assignment``. spill int64 [E], spare int64 [G] ->
    (slot expert int64 [G, slots] (-1 empty), slot tokens int64 [G, slots])."""
    g = spare.shape[0]
    slot_expert = np.full((g, slots), -1, np.int64)
    slot_tokens = np.zeros((g, slots), np.int64)
    experts = np.argsort(-spill, kind="mergesort")
    ranks = np.argsort(-spare, kind="mergesort")
    chunk_end = np.cumsum(spill[experts])
    chunk_start = chunk_end - spill[experts]
    bucket_end = np.cumsum(spare[ranks])
    bucket_start = bucket_end - spare[ranks]
    for j in range(g):
        overlap = np.maximum(
            np.minimum(chunk_end, bucket_end[j]) - np.maximum(chunk_start, bucket_start[j]), 0
        )  # [E] in sorted order
        # NOTE: topk's order among equal overlaps is unspecified upstream; ties to the larger spill here.
        best = np.argsort(-overlap, kind="mergesort")[:slots]
        for s in range(best.shape[0]):
            if overlap[best[s]] > 0:
                slot_expert[ranks[j], s] = experts[best[s]]
                slot_tokens[ranks[j], s] = overlap[best[s]]
    return slot_expert, slot_tokens


@njit(cache=True)
def _plan_layer(x: np.ndarray, slots: int, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """One (micro-batch, layer): x int64 [G, E] -> (assign int64 [E, G], replicas int32 [G, slots])."""
    g, num_experts = x.shape
    per_gpu = num_experts // g
    counts = x.sum(axis=0)
    assign = np.zeros((num_experts, g), np.int64)
    for e in range(num_experts):
        assign[e, e // per_gpu] = counts[e]
    replicas = np.full((g, slots), -1, np.int32)
    if slots == 0 or g == 1:
        return assign, replicas
    spill, spare, avg = _spill_and_spare(counts, g)
    if slots == 1:
        slot_expert, slot_tokens = _approx_bin_packing(spill, spare, avg, num_buckets)
    else:
        slot_expert, slot_tokens = _one_shot_greedy(spill, spare, slots)
    for t in range(g):
        for s in range(slots):
            e = slot_expert[t, s]
            if e >= 0:
                assign[e, e // per_gpu] -= slot_tokens[t, s]
                assign[e, t] += slot_tokens[t, s]
                replicas[t, s] = e
    return assign, replicas


# ---------------------------------------------------------------------------------------- public API
@dataclass(frozen=True)
class EchoLayerPlan:
    """ECHO's plan for one (micro-batch, layer) (for tests and inspection)."""

    spill: np.ndarray
    """int64 [E]: tokens of each expert past its home rank's capacity ``avg``."""
    spare: np.ndarray
    """int64 [G]: room of each rank below ``avg``."""
    average: int
    """``avg``: the total over ``G``, rounded down."""
    slot_expert: np.ndarray
    """int64 [G, slots]: the expert cloned into each echo slot (-1 empty)."""
    slot_tokens: np.ndarray
    """int64 [G, slots]: the tokens each echo slot computes."""


def spill_and_spare(counts: np.ndarray, num_gpus: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``gen_intermediate``: counts int [E] tokens per expert -> (spill int64 [E], spare int64 [G], avg)."""
    return _spill_and_spare(np.ascontiguousarray(counts, dtype=np.int64), int(num_gpus))  # type: ignore[no-any-return]


def offload_plan(counts: np.ndarray, num_gpus: int, slots: int) -> EchoLayerPlan:
    """ECHO's offloading plan for one layer: counts int [E] tokens per expert (summed over sources) ->
    :class:`EchoLayerPlan` (the bin packing for one slot per rank, the one-shot greedy for more)."""
    spill, spare, avg = spill_and_spare(counts, num_gpus)
    if slots == 1:
        slot_expert, slot_tokens = _approx_bin_packing(spill, spare, avg, NUM_BUCKETS)
    else:
        slot_expert, slot_tokens = _one_shot_greedy(spill, spare, int(slots))
    return EchoLayerPlan(spill, spare, int(avg), slot_expert, slot_tokens)


@dataclass(frozen=True)
class EchoPlanner:
    """ECHO as a :class:`~relibra.planners.protocols.Planner`: static placement, per-(micro-batch, layer)
    clones of overloaded experts on under-loaded GPUs anywhere in the EP group.

    ``replica_slots``: echo slots per GPU in every layer (``moe_num_echo_experts // EP``; upstream has no
    default: its config requires the key); 1 selects upstream's approximate bin packing, 2 or more its
    one-shot greedy. ``recompute_expert_dispatch``: ``moe_echo_recompute_expert_dispatch`` (the weights
    dispatched again in the backward). ``critical_path_s``: planning seconds charged per (micro-batch,
    layer) (default :data:`MEASURED_CRITICAL_PATH_S`); None charges the time measured in the run.
    """

    name: str = "echo"
    replica_slots: int = 2
    recompute_expert_dispatch: bool = False
    critical_path_s: float | None = MEASURED_CRITICAL_PATH_S
    redundant_slots: int = 0

    replicas_in_home_node = False
    """Clones go to the under-loaded GPUs anywhere in the EP group (HybridEP dispatches across nodes)."""

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    def __post_init__(self) -> None:
        if self.replica_slots < 1:
            raise ValueError(
                f"planner.replica_slots={self.replica_slots}; need >= 1 (echo slots per GPU, "
                "moe_num_echo_experts // EP)"
            )
        if self.redundant_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}: ECHO's slots are refilled per layer and "
                "micro-batch; use planner.replica_slots"
            )
        if self.critical_path_s is not None and self.critical_path_s < 0:
            raise ValueError(f"planner.critical_path_s={self.critical_path_s}; need >= 0 or null (measured)")

    def cluster_problems(self, num_experts: int, cluster: ClusterSpec) -> list[str]:
        """Upstream picks each slot's expert among the ``E`` experts (``topk`` over them)."""
        if self.replica_slots > num_experts:
            return [
                f"planner.replica_slots={self.replica_slots} exceeds model.num_experts={num_experts}: "
                "ECHO clones at most one copy of each expert per GPU"
            ]
        return []

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with replicas [Mb, L, G, r], assign [Mb, L, E, G] and the
        critical-path record (:class:`~relibra.types.OnlineCopies`)."""
        t0 = time.perf_counter()
        slots = self.replica_slots

        def kernel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return _plan_layer(x, slots, NUM_BUCKETS)  # type: ignore[no-any-return]

        plan = plan_every_microbatch(ctx, kernel, slots, self.critical_path_s, "echo", t0)
        assert plan.online is not None
        online = replace(
            plan.online,
            exposed_copies=3 if self.recompute_expert_dispatch else 2,
            overlapped_gradient_reduce=False,
        )
        return replace(plan, online=online)
