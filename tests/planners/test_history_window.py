"""Each planner declares the history it reads and the simulator hands it exactly that (no silent cut by
``simulator.history_window``), through the control plane and a portfolio too."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.eplb import EplbPlanner
from baselines.eplb_periodic import EplbPeriodicPlanner
from baselines.lplb import LplbPlanner
from baselines.megatron import MegatronPlanner
from baselines.popfetcher import PopFetcherPlanner
from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.planners.portfolio import PortfolioPlanner
from relibra.planners.protocols import history_need
from relibra.simulator import SimOptions, simulate
from relibra.workload import build_workload
from tests.builders import make_cost
from tests.planners.hot_sets import hot_set_counts


def setup(batches: int):
    cost = make_cost(2, 4, 16, num_layers=2, top_k=4)
    counts = hot_set_counts(
        num_experts=16, num_layers=2, top_k=4, num_gpus=8, gpus_per_node=4, batches=batches, tokens=2048,
        hot_share=0.7,
    )  # fmt: skip
    return counts, build_workload(counts, 8, samples_per_microbatch=1), cost


def test_declared_windows() -> None:
    assert history_need(EplbPlanner(load_mode="history"), 4) == 10
    assert history_need(EplbPlanner(load_mode="oracle"), 4) == 0
    assert history_need(LplbPlanner(load_mode="history", history_window=7), 4) == 7
    assert history_need(PopFetcherPlanner(window=12), 4) == 12
    assert history_need(MegatronPlanner(), 4) == 4  # declares nothing: the run's simulator.history_window
    both = PortfolioPlanner("p", (EplbPlanner(load_mode="history"), EplbPeriodicPlanner(name="q")), 0)
    assert history_need(both, 4) == 10


def test_eplb_history_gets_its_ten_batches() -> None:
    """``eplb_history`` promises a 10-batch moving average; with the simulator's default window of 4 it used
    to average at most 4."""
    counts, workload, cost = setup(12)
    res = simulate(
        EplbPlanner(load_mode="history"), counts, workload, cost.cluster, cost.model, cost, SimOptions()
    )
    assert res.metrics["history_batches"] == pytest.approx(sum(min(b, 10) for b in range(12)) / 12)


def test_the_control_plane_hands_history_and_copies_through() -> None:
    """``eplb_periodic`` behind the control plane (its window and the redundant copies in force travel with
    the batch) plans as the bare planner does."""
    counts, workload, cost = setup(9)
    planner = EplbPeriodicPlanner(history_window=6)
    bare = simulate(planner, counts, workload, cost.cluster, cost.model, cost, SimOptions(keep_plans=True))
    with ControlPlane.from_planner(
        planner, cost.cluster, cost.model, cost, ControlPlaneConfig(workers=0)
    ) as cp:
        assert cp.history_batches == 6
        through = simulate(cp, counts, workload, cost.cluster, cost.model, cost, SimOptions(keep_plans=True))
    assert bare.moved[4] > 0
    np.testing.assert_array_equal(through.moved, bare.moved)
    assert through.metrics["history_batches"] == bare.metrics["history_batches"]
    for a, b in zip(through.plans, bare.plans, strict=True):
        np.testing.assert_array_equal(a.redundant, b.redundant)
        np.testing.assert_array_equal(a.assign, b.assign)
