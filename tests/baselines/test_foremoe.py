"""ForeMoE as this suite builds it from the paper's abstract (docs/baselines.md, "ForeMoE"): the two levels
of its planner on hand-derived cases, the plan invariants (copies may cross NVLink domains, slot bound,
token conservation), the two-path transfer engine's pricing, and the refusals before any work."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baselines.foremoe import ForeMoEPlanner, plan_layer
from baselines.megatron import MegatronPlanner
from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.invariants import PlanInvariantError, check_plan
from relibra.simulator import SimOptions, simulate
from tests.builders import HOPPER, cfg, make_ctx, tiny_setup


def test_two_levels_worked_example() -> None:
    """2 domains x 2 GPUs, expert e at home on GPU e, tokens [20, 2, 2, 0], one slot. Level 1: domains hold
    22 and 2 (mean 12): domain 0's hottest expert 0 sends min(20, 10, 10) = 10 tokens to domain 1's least
    loaded GPU 3. Level 2: domain 0 [10, 2] -> expert 0 moves 4 to GPU 1; domain 1 [2, 10] -> 4 of expert
    0 to GPU 2. Every GPU computes 6."""
    x = np.zeros((4, 4), np.int64)
    x[0] = [20, 2, 2, 0]
    a, rep = plan_layer(x, np.arange(4), 2, 1)
    assert a.tolist() == [[6, 4, 4, 6], [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 0, 0]]
    assert rep[:, 0].tolist() == [-1, 0, 0, 0]


def test_one_domain_runs_level_two_only() -> None:
    """One domain of 4: no level-1 move; level 2 evens [20, 2, 2, 0] with copies of expert 0: GPU 3 takes
    min(20, 20 // 2) = 10, then GPU 1 takes (10 - 2) // 2 = 4, GPU 2 takes 4 from GPU 3 ((10 - 2) // 2)."""
    x = np.zeros((4, 4), np.int64)
    x[0] = [20, 2, 2, 0]
    a, rep = plan_layer(x, np.arange(4), 4, 1)
    assert a.sum(axis=0).tolist() == [6, 6, 6, 6] and (a.sum(axis=1) == x.sum(axis=0)).all()
    assert a[0].tolist() == [6, 4, 4, 6] and rep[:, 0].tolist() == [-1, 0, 0, 0]


def test_no_slots_keeps_every_expert_at_home() -> None:
    x = np.zeros((4, 4), np.int64)
    x[0] = [20, 2, 2, 0]
    a, rep = plan_layer(x, np.arange(4), 2, 0)
    assert (a == np.diag(x.sum(axis=0))).all() and rep.shape == (4, 0)


@pytest.mark.parametrize(("nodes", "gpn", "domain"), [(2, 4, None), (2, 4, 8), (4, 2, 4)])
def test_plan_invariants_and_balance(nodes: int, gpn: int, domain: int | None) -> None:
    ctx = make_ctx(nodes=nodes, gpus_per_node=gpn, microbatches=3, samples=96, skew=0.3, nvl_domain=domain)
    plan = ForeMoEPlanner(replica_slots=2).plan(ctx)
    check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=False)
    with pytest.raises(PlanInvariantError):  # level 1 copies leave the domain, so the in-domain bound breaks
        if ctx.cluster.num_domains > 1:
            check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=True)
        else:
            check_plan(plan, ctx, replica_slots=1, replicas_in_home_node=False)
    ours = plan.assign.sum(axis=2).max(axis=-1)
    home = MegatronPlanner().plan(ctx).assign.sum(axis=2).max(axis=-1)
    assert (ours <= home).all() and (ours < home).any()
    assert plan.host_path and plan.online is None
    assert (plan.stats["foremoe_cross_domain_copies_per_layer"] > 0) == (ctx.cluster.num_domains > 1)


def test_engine_prices_each_copy_on_its_faster_path() -> None:
    """Hand hardware: NVLink 450 GB/s x 0.8 = 360, NIC 50 x 0.8 = 40, host 64 GB/s. A copy across domains
    is read from host memory (64 > 40); one inside a domain over NVLink (360 > 64); both at once."""
    cluster = ClusterSpec(2, 2, HOPPER)
    model = tiny_setup()[3]
    cost = CostModel(cluster, model)
    b = cost.expert_weight_bytes()
    home = np.arange(4)[None, :]  # [L=1, E=4]: expert e on GPU e
    rep = np.full((1, 4, 1), -1)
    rep[0, 3, 0] = 0  # expert 0 (GPU 0, domain 0) copied to GPU 3 (domain 1)
    assert cost.engine_copy_time(rep, home)[0] == pytest.approx(b / 64e9)
    rep[0, 1, 0] = 0  # and to GPU 1, inside its domain
    assert cost.engine_copy_time(rep, home)[0] == pytest.approx(max(b / 64e9, cost.fabric_copy_time(
        np.where(np.arange(4)[:, None] == 1, rep[0], -1)[None], home)[0]))  # fmt: skip
    slow_host = CostModel(replace(cluster, hardware=replace(HOPPER, host_bytes_per_s=10e9)), model)
    rep[0, 1, 0] = -1  # the host link slower than the NIC: the fabric carries the copy
    assert slow_host.engine_copy_time(rep, home)[0] == pytest.approx(slow_host.fabric_copy_time(rep, home)[0])
    no_host = CostModel(replace(cluster, hardware=replace(HOPPER, host_bytes_per_s=0.0)), model)
    with pytest.raises(ValueError, match=r"cluster\.hardware\.host_bytes_per_s=0"):
        no_host.engine_copy_time(rep, home)


def test_simulator_hides_the_engine_behind_attention() -> None:
    counts, workload, cluster, model, cost = tiny_setup()
    res = simulate(
        ForeMoEPlanner(replica_slots=2), counts, workload, cluster, model, cost, SimOptions(keep_plans=True)
    )
    fill = np.concatenate([cost.engine_copy_time(p.replicas, p.home) for p in res.plans])  # [M, L]
    np.testing.assert_allclose(res.t_sync_exposed, cost.exposed_refill(fill, res.t_attention))
    assert res.metrics["t_critical_path_s"] == 0.0


def test_refusals() -> None:
    from experiments.config import ConfigError, validate

    with pytest.raises(ValueError, match=r"planner\.redundant_slots"):
        ForeMoEPlanner(redundant_slots=1)
    with pytest.raises(ConfigError, match=r"cluster\.hardware\.host_bytes_per_s=0"):
        validate(cfg("planner=foremoe", "cluster.hardware.host_bytes_per_s=0"))
    validate(cfg("planner=foremoe", "cluster.nodes=2"))
