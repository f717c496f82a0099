"""A portfolio planner: plan each batch with several candidate planners, keep the fastest predicted plan.

Every candidate plans the batch; each plan is priced by the cost model the planner receives, exactly as
the simulated executor prices it (:func:`relibra.cost.pricing.predict_batch_time`: per-layer ``T_MoE``,
attention, exposed replica refill, dense layers and the migration from the previous placement), and the
plan with the lowest predicted batch time is returned. ``planner=relibra_portfolio``, the recommended
configuration, has three candidates: ReLibra's ``T_MoE`` configuration and its balance-first configuration
(two objectives that win at different EP sizes, docs/reorder.md, "Step time against skewness"), both with
the incremental reordering (``relibra_incremental``, ``relibra_balance_incremental``: from the placement in
force, migration charged over a horizon; docs/reorder.md, "Incremental reordering"), and the placement in
force kept (``relibra_keep_placement``: no migration). The kept placement is always a candidate, so the
portfolio never predicts a batch slower than keeping it; it costs the planning work of all three.

Behind the entry point each candidate runs in its own control plane (staged per layer, deadlines and
fallbacks as for ``relibra``), and the portfolio chooses among their plans (``experiments.config.planning``).

Stats: those of the chosen plan, plus ``portfolio_choice`` (index of the chosen candidate),
``portfolio_<name>_s`` (each candidate's predicted batch seconds) and ``portfolio_<name>_plan_s`` (its
planning wall seconds); the simulator averages stats over batches, so ``portfolio_choice`` is the mean
candidate index (with two candidates, the share of batches that took the second).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from relibra.cost.pricing import predict_batch_time
from relibra.planners.protocols import BatchContext, Planner, SlotBudget
from relibra.types import BatchPlan

__all__ = ["PortfolioPlanner", "portfolio"]


@dataclass(frozen=True)
class PortfolioPlanner:
    """Plans with every candidate and keeps the plan with the lowest predicted batch time (ties: first)."""

    name: str
    candidates: tuple[Planner, ...]
    replica_slots: int

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError(f"{self.name}: a portfolio needs at least one candidate planner")
        names = [c.name for c in self.candidates]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: candidate names must be distinct, got {names}")

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
        best = min(range(len(plans)), key=predicted.__getitem__)
        stats = dict(plans[best].stats)
        stats["portfolio_choice"] = float(best)
        for c, t, s in zip(self.candidates, predicted, plan_s, strict=True):
            stats[f"portfolio_{c.name}_s"] = t
            stats[f"portfolio_{c.name}_plan_s"] = s
        return replace(plans[best], plan_time_s=time.perf_counter() - t0, stats=stats)


def portfolio(
    candidates: Mapping[str, Planner],
    replica_slots: int = 2,
    name: str = "relibra_portfolio",
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
    )
