"""LLEP, Least-Loaded Expert Parallelism: spill excess tokens, with their experts' weights, to the least
loaded GPUs of the EP group.

Source: SalesforceAIResearch/LeastLoadedEP (Apache-2.0; arXiv 2601.17111), read and re-implemented, not
copied:

* ``compute_gpu_imbalance_ratio`` and the adaptive switch of ``gptoss_llep_forward``
  (``llep/utils.py``, ``llep/gpt_oss_llep.py``): the LPT path runs only when the per-GPU load under the
  native placement has ``max / mean >= routing_ratio`` (``MOE_ADAPTIVE_LPT_ROUTING_RATIO``, 1.3 in the
  README); else every token is computed at home;
* ``compute_llep_lpt_plan``: capacity ``max_tokens_per_gpu = int(max_tokens_factor * (total // G))``;
  experts in decreasing token count (stable); the native GPU takes what fits its *effective* load
  (assigned + its natives not yet processed), the rest is spilled chunk by chunk to the GPU with the least
  effective load that has room, skipping a chunk smaller than ``min_tokens_per_gemm`` unless it is the
  last; when no GPU has room, the remainder is forced onto the least-loaded one;
* ``llep_lpt_plan_to_compute_ranks``: an expert's tokens are numbered globally, source rank by source
  rank, and chunk ``[start, end)`` of that numbering goes to its GPU, so ``assign[e, g]`` is the sum of the
  chunks given to ``g``;
* the weight transfers: each chunk on a helper (a non-home expert the GPU computes) moves the expert's
  weights from its native GPU (any node: priced on the fabric), asynchronously beside the token dispatch,
  waited for before the expert FFN; in backward the weights' gradients are sent back and waited for
  (``WeightTransferAutograd.backward``).

Pricing (the simulator, :class:`~relibra.types.OnlineCopies`): the plan on the critical path of every
(micro-batch, layer) (upstream computes it on the host after an all-reduce of the counts); the weight
copies and the gradient return each in full. Choices the source leaves open: docs/online_baselines.md, "LLEP".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from relibra.planners.protocols import BatchContext, SlotBudget, static_placement
from relibra.types import BatchPlan, OnlineCopies

__all__ = ["LlepPlanner", "LptPlan", "imbalance_ratio", "lpt_plan"]

MEASURED_CRITICAL_PATH_S = 50e-6
"""This implementation's median planning time per (micro-batch, layer) at EP 64 (Qwen3-235B-A22B shapes,
compiled, one CPU core of a shared machine; docs/online_baselines.md). Upstream plans on the host in Python
after an all-reduce of the counts and publishes no figure: its time is at least this."""


@njit(cache=True, inline="always")
def _chunk(cap: int, load: int, remaining: int, min_tokens_per_gemm: int) -> int:
    """Tokens a helper GPU holding ``load`` takes of ``remaining``: what fits under ``cap``; 0 when nothing
    fits, or when the piece is below the minimum GEMM size and would not finish the expert."""
    room = cap - load
    if room <= 0:
        return 0
    chunk = min(remaining, room)
    if chunk < min_tokens_per_gemm and remaining > chunk:
        return 0
    return chunk


@njit(cache=True, inline="always")
def _emit(out: np.ndarray, n: int, e: int, g: int, tokens: int, assigned: np.ndarray) -> int:
    """Append the chunk (expert ``e``, GPU ``g``, ``tokens``) as row ``n`` of ``out``; returns ``n + 1``."""
    out[n, 0], out[n, 1], out[n, 2] = e, g, tokens
    assigned[g] += tokens
    return n + 1


@njit(cache=True)
def _lpt(counts: np.ndarray, num_gpus: int, max_tokens_factor: float, min_tokens_per_gemm: int):  # type: ignore[no-untyped-def]
    """``compute_llep_lpt_plan`` for one layer. counts int64 [E] ->
    (chunks int64 [n, 3] rows (expert, gpu, tokens) in plan order, n, capacity, forced bool [G])."""
    num_experts = counts.shape[0]
    per_gpu = num_experts // num_gpus
    total = counts.sum()
    balanced = total // num_gpus
    cap = int(max_tokens_factor * balanced) if balanced > 0 else total
    cap = max(cap, 1)
    pending = np.zeros(num_gpus, np.int64)
    for e in range(num_experts):
        pending[e // per_gpu] += counts[e]
    assigned = np.zeros(num_gpus, np.int64)
    forced = np.zeros(num_gpus, np.bool_)
    out = np.zeros((num_experts * num_gpus + num_experts, 3), np.int64)
    n = 0
    order = np.argsort(-counts, kind="mergesort")  # NOTE: stable, as Python's sorted: ties by expert id.
    for e in order:
        tokens = counts[e]
        if tokens == 0:
            continue
        native = e // per_gpu
        pending[native] -= tokens
        native_room = cap - (assigned[native] + pending[native])
        if native_room >= tokens:  # case 1: all at home
            n = _emit(out, n, e, native, tokens, assigned)
            continue
        remaining = tokens
        if native_room > 0:  # case 2: home takes what fits, chunks re-evaluated one at a time
            n = _emit(out, n, e, native, native_room, assigned)
            remaining -= native_room
            while remaining > 0:
                if num_gpus == 1:  # no helper: the home chunk takes the rest (upstream's edge case)
                    out[n - 1, 2] += remaining
                    assigned[native] += remaining
                    break
                eff = assigned + pending
                helpers = np.argsort(eff, kind="mergesort")
                placed = False
                for h in helpers:
                    chunk = 0 if h == native else _chunk(cap, eff[h], remaining, min_tokens_per_gemm)
                    if chunk > 0:
                        n = _emit(out, n, e, h, chunk, assigned)
                        remaining -= chunk
                        placed = True
                        break
                if not placed:
                    h = helpers[0] if helpers[0] != native else helpers[1]
                    n = _emit(out, n, e, h, remaining, assigned)
                    forced[h] = True
                    remaining = 0
            continue
        # case 3: home is full, spill everything; helpers ranked once, by the loads before this expert
        eff = assigned + pending
        helpers = np.argsort(eff, kind="mergesort")
        first = -1
        for h in helpers:
            if h == native:
                continue
            if first < 0:
                first = h
            if remaining <= 0:
                break
            chunk = _chunk(cap, eff[h], remaining, min_tokens_per_gemm)
            if chunk > 0:
                n = _emit(out, n, e, h, chunk, assigned)
                remaining -= chunk
        if remaining > 0:
            h = first if first >= 0 else native
            n = _emit(out, n, e, h, remaining, assigned)
            forced[h] = first >= 0
    return out[:n].copy(), n, cap, forced


@dataclass(frozen=True)
class LptPlan:
    """LLEP's plan for one layer (for tests and inspection)."""

    chunks: np.ndarray
    """int64 [n, 3]: (expert, GPU, tokens) in the order the plan made them."""
    capacity: int
    """``max_tokens_per_gpu``."""
    forced: np.ndarray
    """bool [G]: GPUs that took a forced spill past the capacity."""


def imbalance_ratio(counts: np.ndarray, num_gpus: int) -> float:
    """``compute_gpu_imbalance_ratio``: max / mean per-GPU load of counts [E] under the native placement."""
    loads = np.asarray(counts, dtype=np.float64).reshape(num_gpus, -1).sum(axis=1)
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def lpt_plan(
    counts: np.ndarray, num_gpus: int, max_tokens_factor: float, min_tokens_per_gemm: int
) -> LptPlan:
    """``compute_llep_lpt_plan``: counts int [E] global tokens per expert -> :class:`LptPlan`."""
    chunks, _, cap, forced = _lpt(
        np.ascontiguousarray(counts, dtype=np.int64),
        num_gpus,
        float(max_tokens_factor),
        int(min_tokens_per_gemm),
    )
    return LptPlan(chunks=chunks, capacity=int(cap), forced=forced)


def _assign_and_copies(chunks: np.ndarray, num_experts: int, num_gpus: int) -> tuple[np.ndarray, np.ndarray]:
    """chunks [n, 3] -> (assign int64 [E, G], foreign bool [E, G]: a non-native GPU got a chunk)."""
    assign = np.zeros((num_experts, num_gpus), np.int64)
    np.add.at(assign, (chunks[:, 0], chunks[:, 1]), chunks[:, 2])
    native = np.arange(num_experts) // (num_experts // num_gpus)
    foreign = np.zeros((num_experts, num_gpus), bool)
    spill = chunks[:, 1] != native[chunks[:, 0]]
    foreign[chunks[spill, 0], chunks[spill, 1]] = True
    return assign, foreign


@dataclass(frozen=True)
class LlepPlanner:
    """LLEP as a :class:`~relibra.planners.protocols.Planner`: static placement, per-(micro-batch, layer)
    spills.

    ``routing_ratio``: ``MOE_ADAPTIVE_LPT_ROUTING_RATIO`` (None: the LPT path always runs, as upstream with
    the variable unset); ``max_tokens_factor``: the capacity factor (``EP_MAX_TOKENS_FACTOR``, 1.1 as
    ``compute_llep_lpt_plan``); ``min_tokens_per_gemm``: ``EP_MIN_TOKENS_PER_GEMM`` (1024);
    ``critical_path_s``: planning seconds charged per (micro-batch, layer) (default: this implementation's
    measured median, :data:`MEASURED_CRITICAL_PATH_S`); None charges the time measured in the run. LLEP
    holds foreign experts' weights per transfer (no fixed slots), so
    its copies have no slot bound (``replica_slots`` 0, ``OnlineCopies.fixed_slots`` False); its memory
    bound is the token capacity.
    """

    name: str = "llep"
    routing_ratio: float | None = 1.3
    max_tokens_factor: float = 1.1
    min_tokens_per_gemm: int = 1024
    critical_path_s: float | None = MEASURED_CRITICAL_PATH_S
    redundant_slots: int = 0

    replica_slots: int = 0
    """No fixed slots: foreign weights are allocated per transfer (``OnlineCopies.fixed_slots`` False)."""

    replicas_in_home_node = False
    """Spilled experts go to the least-loaded GPUs anywhere in the EP group."""

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    def __post_init__(self) -> None:
        if self.routing_ratio is not None and self.routing_ratio <= 0:
            raise ValueError(f"planner.routing_ratio={self.routing_ratio}; need > 0, or null (always LPT)")
        if self.max_tokens_factor <= 0:
            raise ValueError(f"planner.max_tokens_factor={self.max_tokens_factor}; need > 0")
        if self.min_tokens_per_gemm < 0:
            raise ValueError(f"planner.min_tokens_per_gemm={self.min_tokens_per_gemm}; need >= 0")
        if self.critical_path_s is not None and self.critical_path_s < 0:
            raise ValueError(f"planner.critical_path_s={self.critical_path_s}; need >= 0 or null (measured)")
        if self.redundant_slots != 0 or self.replica_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}, "
                f"planner.replica_slots={self.replica_slots}: LLEP has no fixed slots (it allocates "
                "foreign weights per transfer); use 0"
            )

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with assign [Mb, L, E, G] and the critical-path record
        (:class:`~relibra.types.OnlineCopies`). No slot table: the foreign experts a GPU holds are the
        non-home experts it computes (the simulator copies each from its home)."""
        t0 = time.perf_counter()
        mb, num_layers, g, num_experts = ctx.load.shape
        home = static_placement(num_layers, num_experts, g)
        counts = np.asarray(ctx.load, dtype=np.int64).sum(axis=2)  # [Mb, L, E]
        assign = np.zeros((mb, num_layers, num_experts, g), np.int64)
        foreign = np.zeros((mb, num_layers, num_experts, g), bool)
        capacity = np.zeros((mb, num_layers), np.int64)
        forced = np.zeros((mb, num_layers, g), bool)
        lpt = np.zeros((mb, num_layers), bool)
        measured = np.zeros((mb, num_layers))
        onehot = home[0][:, None] == np.arange(g)  # [E, G]
        factor, min_gemm = float(self.max_tokens_factor), int(self.min_tokens_per_gemm)
        _lpt(
            counts[0, 0], g, factor, min_gemm
        )  # NOTE: untimed, so a compilation or cache load is not measured.
        for m in range(mb):
            for layer in range(num_layers):
                t = time.perf_counter()
                c = counts[m, layer]
                ratio = imbalance_ratio(c, g)
                if self.routing_ratio is None or ratio >= self.routing_ratio:
                    chunks, _, cap, f = _lpt(c, g, factor, min_gemm)
                    assign[m, layer], foreign[m, layer] = _assign_and_copies(chunks, num_experts, g)
                    capacity[m, layer], forced[m, layer], lpt[m, layer] = cap, f, True
                else:  # the balanced path: every token at home, no capacity is planned to
                    assign[m, layer] = c[:, None] * onehot
                    capacity[m, layer] = np.iinfo(np.int64).max
                measured[m, layer] = time.perf_counter() - t
        charged = measured if self.critical_path_s is None else np.full_like(measured, self.critical_path_s)
        stats = {
            "llep_lpt_share": float(lpt.mean()),
            "llep_forced_spills": float(forced.sum()),
            "llep_weight_transfers_per_layer": float(foreign.sum(axis=(2, 3)).mean()),
            "llep_measured_plan_s_per_layer": float(measured.mean()),
            "llep_critical_path_s_per_layer": float(charged.mean()),
            "reorder_moved_experts": 0.0,
        }
        return BatchPlan(
            home=home,
            assign=assign.astype(np.int32),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            plan_time_s=time.perf_counter() - t0,
            stats=stats,
            online=OnlineCopies(
                critical_path_s=charged,
                exposed_copies=2,
                overlapped_gradient_reduce=False,
                fixed_slots=False,
                token_capacity=capacity,
                over_capacity=forced,
            ),
        )
