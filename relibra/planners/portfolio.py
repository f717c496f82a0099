"""A portfolio planner: plan each batch with several candidate planners, keep the fastest predicted plan.

Every candidate plans the batch; each plan is priced by the cost model the planner receives, exactly as
the simulated executor prices it (:func:`relibra.cost.pricing.predict_batch_time`: per-layer ``T_MoE``,
attention, exposed replica refill, dense layers and the migration from the previous placement), and the
plan with the lowest predicted batch time is returned. ``planner=relibra_portfolio``, the recommended
configuration, has two candidates: ReLibra's balance-first configuration with the incremental reordering
(``relibra_balance_incremental``: from the placement in force, migration charged over a horizon;
docs/reorder.md, "Incremental reordering") and the placement in force kept (``relibra_keep_placement``: no
migration). The kept placement is always a candidate, so the portfolio never predicts a batch slower than
keeping it; it costs the planning work of both.

Behind the entry point each candidate runs in its own control plane (staged per layer, deadlines and
fallbacks as for ``relibra``), and the portfolio chooses among their plans
(``experiments.config.build.planning``).

**Predicted lifetime** (``lifetime_window`` > 0, beyond the paper): a placement that moves experts serves
more than the batch it is planned for, so charging its whole migration to that batch undervalues a lasting
change (a whole node hot, whose load the home node cannot absorb: only moving experts across nodes helps).
With ``lifetime_window = K`` the portfolio reads the last ``K`` batches' loads (``ctx.history``, declared
as :attr:`history_batches`) and predicts each candidate placement's lifetime from them as
``benchmarks/bench_horizon.py`` measures it, looking back instead of forward: ``r(k)``, the share of the
candidate's saving on this batch that it would have given ``k`` batches ago, both over the placement in
force and by home-only ``T_MoE`` (:meth:`~relibra.cost.model.CostModel.moe`), clipped to ``[0, 1]``; the
lifetime is ``H = 1 + sum_k r(k)`` (``H = 1`` with no history or no saving), at most the batches left in
the run (``BatchContext.batches_left``, which a trainer knows from its training steps: a move on the last
batch serves that batch alone). The candidate is then scored
with its migration spread over ``H`` batches: ``predicted - migration * (1 - 1 / H)``, so the move horizon a
batch acts on is the one its own prediction supports, not a fixed one (a candidate planned with a long
``reorder.horizon`` proposes the moves such a lifetime pays for). Open choices, stated: the look-back stands
for the future (routing that has stayed put is expected to stay put, as RL policies drift slowly between
steps); the saving is measured without replication, which removes part of any imbalance inside a node.
With ``lifetime_window = 0`` (the default) every plan is charged its full migration, as before.

Stats: those of the chosen plan, plus ``portfolio_choice`` (index of the chosen candidate),
``portfolio_<name>_s`` (each candidate's predicted batch seconds; with ``lifetime_window``, its migration
spread over ``portfolio_<name>_lifetime`` batches) and ``portfolio_<name>_plan_s`` (its
planning wall seconds); the simulator averages stats over batches, so ``portfolio_choice`` is the mean
candidate index (with two candidates, the share of batches that took the second).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from relibra.cost.migration import migration_cost
from relibra.cost.model import CostModel
from relibra.cost.pricing import predict_batch_time
from relibra.planners.protocols import BatchContext, Planner, SlotBudget, home_assign, previous_home
from relibra.types import BatchPlan

__all__ = ["PortfolioPlanner", "placement_lifetime", "portfolio"]


def _home_seconds(cost: CostModel, load: np.ndarray, home: np.ndarray) -> float:
    """Home-only ``T_MoE`` seconds of load [Mb, L, G, E] under home [L, E], summed."""
    return float(cost.moe(load, home_assign(load, home, cost.cluster.num_gpus)).t_moe.sum())


def placement_lifetime(
    cost: CostModel, load: np.ndarray, history: tuple[np.ndarray, ...], prev: np.ndarray, home: np.ndarray
) -> float:
    """Predicted batches a move from ``prev`` to ``home`` (int [L, E]) keeps its saving: ``1 + sum_k r(k)``
    over the ``K`` history batches, ``r(k)`` the saving (home-only ``T_MoE`` over ``prev``) on the batch ``k``
    back as a share of the saving on this batch's ``load`` [Mb, L, G, E], clipped to ``[0, 1]``; 1 with no
    saving now. history: loads [Mb', L, G, E], oldest first."""
    if np.array_equal(prev, home) or not history:
        return 1.0
    now = _home_seconds(cost, load, prev) - _home_seconds(cost, load, home)
    if now <= 0:
        return 1.0
    past = [_home_seconds(cost, h, prev) - _home_seconds(cost, h, home) for h in history]
    return 1.0 + float(np.clip(np.asarray(past) / now, 0.0, 1.0).sum())


@dataclass(frozen=True)
class PortfolioPlanner:
    """Plans with every candidate and keeps the plan with the lowest predicted batch time (ties: first)."""

    name: str
    candidates: tuple[Planner, ...]
    replica_slots: int
    lifetime_window: int = 0
    """Batches of history from which each candidate placement's lifetime is predicted (0: off, every plan
    pays its full migration)."""

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError(f"{self.name}: a portfolio needs at least one candidate planner")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: candidate names must be distinct, got {names}")
        if self.lifetime_window < 0:
            raise ValueError(f"lifetime_window={self.lifetime_window}; need >= 0 batches (0: off)")

    @property
    def history_batches(self) -> int:
        """The history the lifetime prediction reads (the simulator hands it, :func:`history_need`)."""
        return self.lifetime_window

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(replica_slots=self.replica_slots)

    def candidate_planners(self) -> tuple[Planner, ...]:
        return self.candidates

    def with_candidates(self, candidates: tuple[Planner, ...]) -> PortfolioPlanner:
        return replace(self, candidates=candidates)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        t0 = time.perf_counter()
        plans, plan_s = [], []
        for c in self.candidates:
            t = time.perf_counter()
            plans.append(c.plan(ctx))
            plan_s.append(time.perf_counter() - t)
        predicted = [predict_batch_time(p, ctx) for p in plans]
        lifetimes = [1.0] * len(plans)
        window = tuple(ctx.history[-self.lifetime_window :]) if self.lifetime_window else ()
        if window:
            prev = previous_home(ctx)
            for i, p in enumerate(plans):
                lifetimes[i] = placement_lifetime(ctx.cost, np.asarray(p.load), window, prev, p.home)
                if ctx.batches_left is not None:
                    lifetimes[i] = min(lifetimes[i], float(ctx.batches_left))
                migration = migration_cost(ctx.cost, prev, p.home).exposed_s
                predicted[i] -= migration * (1.0 - 1.0 / lifetimes[i])
        best = min(range(len(plans)), key=predicted.__getitem__)
        stats = dict(plans[best].stats)
        stats["portfolio_choice"] = float(best)
        for c, t, s, h in zip(self.candidates, predicted, plan_s, lifetimes, strict=True):
            stats[f"portfolio_{c.name}_s"] = t
            stats[f"portfolio_{c.name}_plan_s"] = s
            if self.lifetime_window:
                stats[f"portfolio_{c.name}_lifetime"] = h
        return replace(plans[best], plan_time_s=time.perf_counter() - t0, stats=stats)


def portfolio(
    candidates: Mapping[str, Planner],
    replica_slots: int = 2,
    name: str = "relibra_portfolio",
    lifetime_window: int = 0,
) -> PortfolioPlanner:
    """Hydra factory: ``candidates`` maps a label to an instantiated planner (order kept). Plans are priced
    with ``ctx.cost``, whose migration payload is the simulator's (``CostModel.migration``)."""
    for label, planner in candidates.items():
        if not isinstance(planner, Planner):
            raise ValueError(f"{name}: candidates.{label} is not a planner (got {type(planner).__name__})")
    return PortfolioPlanner(
        name=name,
        candidates=tuple(candidates.values()),
        replica_slots=replica_slots,
        lifetime_window=lifetime_window,
    )
