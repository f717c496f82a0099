"""EPLB as vLLM and SGLang deploy it: rebalance every ``rebalance_interval`` steps from a window of history,
and keep the placement in force between rebalances and wherever a new one is predicted no better.

Sources (read at their source, not copied):

* vLLM ``vllm/config/parallel.py`` ``EPLBConfig`` (commit 00193b82): ``window_size=1000`` steps of recorded
  expert load, ``step_interval=3000`` steps between rearrangements ("if this is greater than the window size,
  only the last ``window_size`` steps are used"), ``num_redundant_experts=0``; ``vllm/distributed/eplb/``
  rearranges with DeepSeek's EPLB policy on the window's summed load and moves weights between ranks;
* SGLang ``python/sglang/srt/server_args.py`` and ``srt/eplb/eplb_manager.py``:
  ``eplb_rebalance_num_iterations=1000`` forward passes between rebalances,
  ``expert_distribution_recorder_buffer_size`` defaulting to that same number (the window equals the
  interval), ``eplb_min_rebalancing_utilization_threshold=1.0`` (rebalance only when the window's mean/max
  GPU utilisation is below it: by default, whenever the load is not perfectly even),
  ``ep_num_redundant_experts=0``.

Both count inference forward passes (engine steps); here a step is one RL training step (one batch), so
their 1000 / 3000 have no counterpart and the defaults are in batches: ``rebalance_interval = 4`` and
``history_window = 4`` (SGLang's window equal to its interval), which is the placement lifetime measured on
the synthetic traces (docs/records/reorder.md, "Placement lifetime"; the horizon of ``relibra_portfolio``).
``redundant_slots = 2`` as ``eplb`` (EPLB+), so the two compare on one memory budget; the upstream
default 0 is ``planner.redundant_slots=0``. As upstream, the first rebalance comes after
``rebalance_interval`` steps (steps ``rebalance_interval, 2 * rebalance_interval, ...``); before it,
Megatron-LM's static placement runs, with the redundant slots empty.

**Keep if not better** (``keep_if_not_better``, on by default; beyond both upstreams, whose nearest rule is
SGLang's utilisation threshold): at a rebalance, the new EPLB placement replaces the one in force only when
its predicted seconds per batch on the window's loads, with the migration it needs spread over the
``rebalance_interval`` batches it will serve, are lower than the kept placement's on the same loads. The
prediction uses only the window (what the planner has; never this batch's loads): per history batch,
``T_MoE`` of every (micro-batch, layer) under EPLB's even token split over the copies
(:meth:`~relibra.cost.model.CostModel.moe`), plus the redundant copies' gradient sync; the migration is
:func:`~relibra.cost.migration.migration_cost` of the homes that change, as the simulator charges it.

Between rebalances the placement in force (homes and redundant copies, ``BatchContext.prev_home`` and
``prev_redundant``) serves the batch; its tokens are split evenly over each expert's copies, as EPLB does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from baselines.eplb import EplbPlanner, Policy, even_split
from relibra.cost.migration import migration_cost
from relibra.cost.model import CostModel
from relibra.cost.pricing import redundant_sync_time
from relibra.planners.protocols import BatchContext, SlotBudget, previous_home
from relibra.types import BatchPlan

__all__ = ["EplbPeriodicPlanner", "kept_copies", "window_seconds"]


def kept_copies(home: np.ndarray, redundant: np.ndarray | None, num_gpus: int) -> np.ndarray:
    """Copies of each expert on each GPU for homes [L, E] and redundant slots [L, G, W] (-1 empty, or None)
    -> int64 [L, E, G]."""
    num_layers, num_experts = home.shape
    copies = np.zeros((num_layers, num_experts, num_gpus), dtype=np.int64)
    np.add.at(copies, (np.arange(num_layers)[:, None], np.arange(num_experts)[None, :], home), 1)
    if redundant is not None:
        l_idx, g_idx, s_idx = np.nonzero(redundant >= 0)
        np.add.at(copies, (l_idx, redundant[l_idx, g_idx, s_idx], g_idx), 1)
    return copies


def window_seconds(cost: CostModel, window: tuple[np.ndarray, ...], copies: np.ndarray) -> float:
    """Mean over the window's batches of the summed ``T_MoE`` seconds under EPLB's even split over ``copies``.

    window: loads [Mb', L, G, E] of earlier batches; copies int [L, E, G] -> seconds per batch.
    """
    total = 0.0
    for load in window:
        x = np.asarray(load)
        assign = even_split(x.sum(axis=-2), copies[None])
        total += float(cost.moe(x, assign).t_moe.sum())
    return total / max(len(window), 1)


@dataclass(frozen=True)
class EplbPeriodicPlanner:
    """EPLB rebalanced every ``rebalance_interval`` batches from the mean load of the last ``history_window``
    batches (hierarchical policy, ``redundant_slots`` per GPU), kept in between and wherever a new placement
    is predicted no better (``keep_if_not_better``). Defaults and sources: the module docstring."""

    name: str = "eplb_periodic"
    redundant_slots: int = 2
    replica_slots: int = 0
    policy: Policy = "hierarchical"
    num_groups: int = 0
    rebalance_interval: int = 4
    history_window: int = 4
    keep_if_not_better: bool = True

    def __post_init__(self) -> None:
        if self.rebalance_interval < 1:
            raise ValueError(f"planner.rebalance_interval={self.rebalance_interval}; need >= 1 batch")
        if self.history_window < 1:
            raise ValueError(f"planner.history_window={self.history_window}; need >= 1 batch")
        self._eplb()  # NOTE: EPLB's own checks of the shared fields (redundant_slots, policy, ...).

    def _eplb(self) -> EplbPlanner:
        return EplbPlanner(
            name=self.name,
            redundant_slots=self.redundant_slots,
            replica_slots=self.replica_slots,
            policy=self.policy,
            num_groups=self.num_groups,
            load_mode="history",
            history_window=self.history_window,
        )

    @property
    def slot_budget(self) -> SlotBudget:
        return self._eplb().slot_budget

    @property
    def history_batches(self) -> int:
        """Batches of past loads it reads: its window."""
        return self.history_window

    def due(self, batch: int) -> bool:
        """Whether batch ``batch`` is a rebalance step (``rebalance_interval``, twice that, ...)."""
        return batch > 0 and batch % self.rebalance_interval == 0

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with home [L, E], redundant [L, G, W], assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        num_layers = ctx.counts.shape[1]
        g = ctx.num_gpus
        home = previous_home(ctx)
        redundant = ctx.prev_redundant
        if redundant is None:
            redundant = np.full((num_layers, g, self.redundant_slots), -1, dtype=np.int32)
        copies = kept_copies(home, redundant, g)
        kept = BatchPlan(
            home=home,
            assign=even_split(np.asarray(ctx.load).sum(axis=2), copies[None]),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            redundant=np.asarray(redundant, dtype=np.int32),
        )
        window = tuple(ctx.history[-self.history_window :])
        stats = {"eplb_rebalance_due": 0.0, "eplb_rebalanced": 0.0, "history_batches": float(len(window))}
        plan = kept
        if self.due(ctx.batch) and window:
            stats["eplb_rebalance_due"] = 1.0
            new = self._eplb().plan(ctx)
            take = True
            if self.keep_if_not_better:
                cost = ctx.cost
                t_new = window_seconds(cost, window, kept_copies(new.home, new.redundant, g))
                t_new += redundant_sync_time(new, cost)
                t_new += migration_cost(cost, home, new.home).exposed_s / self.rebalance_interval
                t_keep = window_seconds(cost, window, copies) + redundant_sync_time(kept, cost)
                stats["eplb_predicted_new_s"], stats["eplb_predicted_keep_s"] = t_new, t_keep
                take = t_new < t_keep
            if take:
                plan = new
                stats["eplb_rebalanced"] = 1.0
        stats = {**plan.stats, **stats}
        return replace(plan, stats=stats, plan_time_s=time.perf_counter() - t0)
