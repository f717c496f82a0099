"""The portfolio planner and the batch-time prediction it chooses by (relibra.planners.portfolio)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from baselines.megatron import MegatronPlanner
from relibra.cost.migration import MigrationPayload
from relibra.cost.model import CostModel
from relibra.cost.pricing import predict_batch_time
from relibra.invariants import check_plan
from relibra.planners.compose import PreviousReorderer, relibra, relibra_replicate_only
from relibra.planners.portfolio import PortfolioPlanner, portfolio
from relibra.planners.protocols import BatchContext, Planner, SlotBudget
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyConfig
from relibra.simulator import batch_context, simulate
from relibra.types import BatchPlan
from tests.builders import tiny_setup

CONF = str(Path(__file__).resolve().parents[2] / "experiments" / "conf")
FAST_REORDER = {"iterations": 200, "seeds": (0,), "workers": 1}


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(nodes=2, gpus_per_node=4, num_experts=16, samples_per_microbatch=2)


def _candidates() -> list[Planner]:
    return [
        MegatronPlanner(),
        relibra_replicate_only(replica_slots=2),
        relibra(replica_slots=2, reorder=AnnealConfig(**FAST_REORDER)),
        relibra(
            replica_slots=2,
            reorder=AnnealConfig(**{**FAST_REORDER, "comm_weight": 0.0, "compute_level": "node"}),
            replicate=GreedyConfig(acceptance="compute"),
            name="relibra_balance",
        ),
    ]


@pytest.mark.parametrize("index", range(4))
def test_prediction_is_the_simulated_batch_time(setup, index: int) -> None:
    """Batch by batch, the prediction equals what the simulator charges (same previous placement)."""
    counts, workload, cluster, model, cost = setup
    planner = _candidates()[index]
    predicted, prev = [], None
    for b in range(counts.num_batches):
        ctx = batch_context(counts, workload, b, cluster, model, cost, prev_home=prev)
        plan = planner.plan(ctx)
        predicted.append(predict_batch_time(plan, ctx))
        prev = plan.home
    sim = simulate(planner, counts, workload, cluster, model, cost)
    assert np.mean(predicted) == pytest.approx(sim.metrics["step_time_s"], rel=1e-12)


def test_portfolio_keeps_the_fastest_candidate(setup) -> None:
    counts, workload, cluster, model, cost = setup
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    candidates = _candidates()
    times = [predict_batch_time(c.plan(ctx), ctx) for c in candidates]
    assert len(set(times)) == len(times)  # NOTE: distinct, so the choice below is unambiguous
    chosen = PortfolioPlanner("portfolio", tuple(candidates), replica_slots=2).plan(ctx)
    best = int(np.argmin(times))
    assert chosen.stats["portfolio_choice"] == best
    assert predict_batch_time(chosen, ctx) == pytest.approx(min(times), rel=1e-12)
    np.testing.assert_array_equal(chosen.assign, candidates[best].plan(ctx).assign)
    for c, t in zip(candidates, times, strict=True):
        assert chosen.stats[f"portfolio_{c.name}_s"] == pytest.approx(t, rel=1e-12)
    check_plan(chosen, ctx, replica_slots=2, replicas_in_home_node=True)
    assert chosen.plan_time_s > 0


@dataclass(frozen=True)
class _Fixed:
    """A planner that hands back one plan whatever the batch (to force the portfolio's choice)."""

    name: str
    plan_: BatchPlan
    slot_budget: SlotBudget = field(default_factory=SlotBudget)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        return self.plan_


def test_portfolio_ties_take_the_first_and_order_matters(setup) -> None:
    counts, workload, cluster, model, cost = setup
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    plan = MegatronPlanner().plan(ctx)
    chosen = PortfolioPlanner("p", (_Fixed("a", plan), _Fixed("b", plan)), replica_slots=0).plan(ctx)
    assert chosen.stats["portfolio_choice"] == 0


def test_portfolio_refuses_bad_candidates() -> None:
    with pytest.raises(ValueError, match="at least one candidate"):
        PortfolioPlanner("p", (), replica_slots=2)
    with pytest.raises(ValueError, match="distinct"):
        PortfolioPlanner("p", (MegatronPlanner(), MegatronPlanner()), replica_slots=2)
    with pytest.raises(ValueError, match=r"candidates\.x is not a planner"):
        portfolio({"x": 3})  # type: ignore[dict-item]


def test_portfolio_config_composes_its_two_candidates() -> None:
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "planner=relibra_portfolio",
                "planner.replica_slots=3",
            ],
        )
    planner = instantiate(cfg.planner, _convert_="all")
    assert isinstance(planner, PortfolioPlanner) and isinstance(planner, Planner)
    assert planner.name == "relibra_portfolio" and planner.replica_slots == 3
    balance, keep = planner.candidates
    assert (balance.name, keep.name) == ("relibra_balance_incremental", "relibra_keep_placement")
    # the recommended configuration reorders incrementally
    assert balance.reorderer.config.start == "previous"  # type: ignore[attr-defined]
    assert balance.reorderer.config.horizon == cfg.planner.candidates.balance.reorder.horizon > 0  # type: ignore[attr-defined]
    assert balance.replica_slots == keep.replica_slots == 3  # type: ignore[attr-defined]
    assert isinstance(keep.reorderer, PreviousReorderer)  # type: ignore[attr-defined]
    assert balance.replicator.config.acceptance == "compute"  # type: ignore[attr-defined]
    assert balance.reorderer.config.comm_weight == 0.0  # type: ignore[attr-defined]


def test_keep_placement_keeps_the_previous_placement_and_moves_nothing(setup) -> None:
    counts, workload, cluster, model, cost = setup
    first = batch_context(counts, workload, 0, cluster, model, cost)
    keep = relibra_replicate_only(replica_slots=2, placement="previous", name="relibra_keep_placement")
    plan0 = keep.plan(first)  # no previous placement: Megatron-LM's static one
    np.testing.assert_array_equal(plan0.home, relibra_replicate_only(replica_slots=2).plan(first).home)
    prev = relibra(replica_slots=2, reorder=AnnealConfig(**FAST_REORDER)).plan(first).home
    ctx = batch_context(counts, workload, 1, cluster, model, cost, prev_home=prev)
    plan = keep.plan(ctx)
    np.testing.assert_array_equal(plan.home, prev)
    check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=True)
    moved = relibra(replica_slots=2, reorder=AnnealConfig(**FAST_REORDER)).plan(ctx)
    assert (moved.home != prev).any()
    # With migration priced 1000x higher, keeping the placement must win the portfolio.
    heavy = CostModel(cluster, model, migration=MigrationPayload(weight_bytes=2e3, master_weight_bytes=12e3))
    heavy_ctx = batch_context(counts, workload, 1, cluster, model, heavy, prev_home=prev)
    chosen = PortfolioPlanner(
        "p", (relibra(replica_slots=2, reorder=AnnealConfig(**FAST_REORDER)), keep), 2
    ).plan(heavy_ctx)
    assert chosen.stats["portfolio_choice"] == 1.0
    np.testing.assert_array_equal(chosen.home, prev)
    with pytest.raises(ValueError, match="prev_home"):
        keep.plan(batch_context(counts, workload, 1, cluster, model, cost, prev_home=prev[:, :-1]))
    with pytest.raises(ValueError, match="placement='latest'"):
        relibra_replicate_only(replica_slots=2, placement="latest")
