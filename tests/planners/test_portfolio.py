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


def test_portfolio_config_composes_its_three_candidates() -> None:
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
    balance, spread, keep = planner.candidates
    assert (balance.name, spread.name, keep.name) == (
        "relibra_balance_incremental",
        "relibra_spread_incremental",
        "relibra_keep_placement",
    )
    # the recommended configuration reorders incrementally
    for c in (balance, spread):
        assert c.reorderer.config.start == "previous"  # type: ignore[attr-defined]
    assert balance.reorderer.config.horizon == cfg.planner.candidates.balance.reorder.horizon > 0  # type: ignore[attr-defined]
    assert spread.reorderer.config.horizon > balance.reorderer.config.horizon  # type: ignore[attr-defined]
    assert balance.replica_slots == spread.replica_slots == keep.replica_slots == 3  # type: ignore[attr-defined]
    assert isinstance(keep.reorderer, PreviousReorderer)  # type: ignore[attr-defined]
    assert balance.replicator.config.acceptance == "compute"  # type: ignore[attr-defined]
    assert balance.reorderer.config.comm_weight == 0.0  # type: ignore[attr-defined]
    assert spread.reorderer.config.comm_weight == 1.0  # type: ignore[attr-defined]
    assert planner.lifetime_window == planner.history_batches == 12


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


# ------------------------------------------------------------------------------ predicted lifetime
def _hot_node(batches: int, hot_share: float):
    """2 nodes x 4 GPUs, 16 Qwen3-30B-A3B-shaped experts, 2 layers; node 0's experts take ``hot_share``."""
    from relibra.workload import build_workload
    from tests.builders import make_cost
    from tests.planners.hot_sets import hot_set_counts

    cost = make_cost(2, 4, 16, num_layers=2, top_k=4)
    counts = hot_set_counts(
        num_experts=16, num_layers=2, top_k=4, num_gpus=8, gpus_per_node=4, batches=batches, tokens=4096,
        hot_share=hot_share,
    )  # fmt: skip
    return counts, build_workload(counts, 8, samples_per_microbatch=1), cost


def test_placement_lifetime_counts_the_batches_a_saving_lasted() -> None:
    from relibra.planners.portfolio import placement_lifetime
    from relibra.planners.protocols import static_placement

    counts, workload, cost = _hot_node(4, 0.8)
    loads = [batch_context(counts, workload, b, cost.cluster, cost.model, cost).load for b in range(4)]
    prev = static_placement(2, 16, 8)
    spread = np.broadcast_to(np.arange(16) % 8, (2, 16)).astype(np.int32)  # node 0's experts over both nodes
    assert placement_lifetime(cost, loads[3], tuple(loads[:3]), prev, spread) == pytest.approx(4.0, abs=0.1)
    assert placement_lifetime(cost, loads[3], (), prev, spread) == 1.0
    assert placement_lifetime(cost, loads[3], tuple(loads[:3]), prev, prev) == 1.0
    cool, cool_wl, _ = _hot_node(4, 0.5)  # balanced routing: the spread saves nothing in the past
    past = tuple(batch_context(cool, cool_wl, b, cost.cluster, cost.model, cost).load for b in range(3))
    assert placement_lifetime(cost, loads[3], past, prev, spread) < 1.5


def _portfolio_cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["planner=relibra_portfolio", *overrides])
    return instantiate(cfg.planner, _convert_="all")


def test_a_lasting_hot_node_is_spread_across_nodes() -> None:
    """A whole node hot for 5 batches: the portfolio with the spread candidate and the predicted lifetime
    moves experts off the node and is faster than the former two-candidate portfolio, which never moved."""
    counts, workload, cost = _hot_node(5, 0.8)
    fast = [f"planner.candidates.{c}.reorder.iterations=300" for c in ("balance", "spread")]
    now = simulate(_portfolio_cfg(*fast), counts, workload, cost.cluster, cost.model, cost)
    before = simulate(
        _portfolio_cfg(fast[0], "planner.lifetime_window=0", "~planner.candidates.spread"),
        counts, workload, cost.cluster, cost.model, cost,
    )  # fmt: skip
    assert now.moved.sum() > 0
    assert now.metrics["step_time_s"] < before.metrics["step_time_s"]


@dataclass(frozen=True)
class _FixedHome:
    """A planner that always answers the same placement, every expert computed at home."""

    name: str
    home: np.ndarray
    slot_budget: SlotBudget = field(default_factory=SlotBudget)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        from relibra.planners.protocols import home_assign

        load = np.asarray(ctx.load)
        return BatchPlan(home=self.home, assign=home_assign(load, self.home, ctx.num_gpus), load=load,
                         sample_gpu=ctx.sample_gpu)  # fmt: skip


def test_the_lifetime_is_capped_by_the_batches_left_in_the_run() -> None:
    """A move on the last batch of a run serves that batch alone: no lifetime is credited beyond it."""
    from dataclasses import replace as dc_replace

    from relibra.planners.protocols import static_placement

    counts, workload, cost = _hot_node(4, 0.8)
    history = tuple(batch_context(counts, workload, b, cost.cluster, cost.model, cost).load for b in range(3))
    ctx = dc_replace(batch_context(counts, workload, 3, cost.cluster, cost.model, cost), history=history)
    spread = np.broadcast_to(np.arange(16) % 8, (2, 16)).astype(np.int32)
    chooser = PortfolioPlanner(
        "p", (_FixedHome("keep", static_placement(2, 16, 8)), _FixedHome("spread", spread)), 0, 3
    )
    lifetimes = {}
    for left in (None, 2, 1):
        stats = chooser.plan(dc_replace(ctx, batches_left=left)).stats
        lifetimes[left] = stats["portfolio_spread_lifetime"]
        assert stats["portfolio_keep_lifetime"] == 1.0
    assert lifetimes[None] == pytest.approx(4.0, abs=0.1) and lifetimes[2] == 2.0 and lifetimes[1] == 1.0
