"""EPLB as deployed (``eplb_periodic``): rebalances only on its interval, keeps the placement in force (homes
and redundant copies) in between, and never re-homes experts for a placement predicted no better."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baselines.eplb import EplbPlanner
from baselines.eplb_periodic import EplbPeriodicPlanner, kept_copies
from relibra.simulator import SimOptions, simulate
from relibra.workload import build_workload
from tests.baselines.test_eplb import check_redundant_plan
from tests.builders import make_cost, make_ctx
from tests.planners.hot_sets import hot_set_counts


def run(planner: EplbPeriodicPlanner, hot_share: float, batches: int = 9, rotate: bool = False):
    """Simulate ``planner`` on 2 nodes x 4 GPUs, 16 Qwen3-30B-A3B-shaped experts, 2 layers."""
    cost = make_cost(2, 4, 16, num_layers=2, top_k=4)
    counts = hot_set_counts(
        num_experts=16, num_layers=2, top_k=4, num_gpus=8, gpus_per_node=4, batches=batches, tokens=4096,
        hot_share=hot_share, rotate=rotate,
    )  # fmt: skip
    workload = build_workload(counts, 8, samples_per_microbatch=1)
    return simulate(planner, counts, workload, cost.cluster, cost.model, cost, SimOptions(check_plans=True))


def test_rebalances_only_on_its_interval_and_keeps_copies_in_between() -> None:
    planner = EplbPeriodicPlanner(rebalance_interval=4, keep_if_not_better=False)
    ctx = make_ctx(history=3)
    assert [planner.due(b) for b in range(9)] == [False, False, False, False, True, False, False, False, True]
    due = replace(ctx, batch=4)
    new = planner.plan(due)
    check_redundant_plan(new, due, 2)
    np.testing.assert_array_equal(new.home, EplbPlanner(load_mode="history", history_window=4).plan(due).home)
    later = replace(ctx, batch=5, prev_home=new.home, prev_redundant=new.redundant)
    kept = planner.plan(later)
    np.testing.assert_array_equal(kept.home, new.home)
    np.testing.assert_array_equal(kept.redundant, new.redundant)
    copies = kept_copies(new.home, new.redundant, ctx.num_gpus)
    assert ((kept.assign > 0) <= (copies[None] > 0)).all()  # tokens only where a copy is held
    assert kept.stats["eplb_rebalanced"] == 0.0 and new.stats["eplb_rebalanced"] == 1.0


def test_balanced_routing_moves_nothing() -> None:
    """With the upstream defaults' slots (none redundant), no new placement pays for its moves on balanced
    routing: nothing is re-homed. Without the rule every rebalance re-homes experts, and the run is slower."""
    kept = run(EplbPeriodicPlanner(redundant_slots=0), hot_share=0.5)
    assert kept.moved.sum() == 0
    moving = run(EplbPeriodicPlanner(redundant_slots=0, keep_if_not_better=False), hot_share=0.5)
    assert moving.moved[[4, 8]].min() > 0
    assert kept.metrics["step_time_s"] < moving.metrics["step_time_s"]


def test_a_fitted_placement_is_kept_at_the_next_rebalance() -> None:
    """A lasting hot node: the first rebalance re-homes; at the second the placement in force already fits,
    and only the variant without the rule re-homes again (and pays for it)."""
    kept = run(EplbPeriodicPlanner(), hot_share=0.7)
    moving = run(EplbPeriodicPlanner(keep_if_not_better=False), hot_share=0.7)
    assert kept.moved[4] > 0 and kept.moved[8] == 0 and moving.moved[8] > 0
    assert kept.batch_time[8] < moving.batch_time[8]


def test_a_lasting_hot_node_is_rebalanced_and_pays() -> None:
    hot = run(EplbPeriodicPlanner(rebalance_interval=4), hot_share=0.7)
    assert hot.moved[4] > 0 and hot.moved[[1, 2, 3, 5, 6, 7]].sum() == 0
    static = run(EplbPeriodicPlanner(rebalance_interval=100), hot_share=0.7)
    assert static.moved.sum() == 0
    assert hot.metrics["step_time_s"] < static.metrics["step_time_s"]


def test_declares_its_window_and_gets_it() -> None:
    """The simulator's default window (4) does not cut the planner's own (6)."""
    res = run(EplbPeriodicPlanner(rebalance_interval=8, history_window=6), hot_share=0.7, batches=9)
    assert res.metrics["history_batches"] == pytest.approx(sum(min(b, 6) for b in range(9)) / 9)


def test_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match=r"planner\.rebalance_interval=0"):
        EplbPeriodicPlanner(rebalance_interval=0)
    with pytest.raises(ValueError, match=r"planner\.history_window=0"):
        EplbPeriodicPlanner(history_window=0)
    with pytest.raises(ValueError, match="replica_slots"):
        EplbPeriodicPlanner(replica_slots=1)
