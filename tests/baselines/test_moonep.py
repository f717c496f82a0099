"""MoonEP against its source: the two greedy passes on hand-derived cases (steps in the docstrings follow
``tests/planning_reference.py`` of the public fork and Megatron-core's
``_plan_virtual_expert_placement_kernel``; neither publishes a fixed numeric example, their tests draw random
routings), the plan invariants inside NVLink domains, the pricing, and the entry point's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.megatron import MegatronPlanner
from baselines.moonep import MoonEPPlanner, allocate, receive_caps, receive_quotas
from relibra.invariants import PlanInvariantError, check_plan
from relibra.simulator import simulate
from tests.builders import cfg, make_ctx, tiny_setup


def test_worked_example() -> None:
    """4 ranks x 2 experts, counts [10, 6 | 1, 1 | 2, 2 | 0, 2] (24 slots, cap 6 each): balance
    [10, -4, -2, -4]. Step 1: group 0 fills rank 1 (4, the first minimum), then rank 3 (4), then rank 2 (2).
    Step 2: group 0's largest quota (rank 1, 4) from its largest expert 0 (10 -> 6); rank 3's 4 from expert 0
    again (6 ties 6: the lower expert); rank 2's 2 from expert 1."""
    count = np.array([10, 6, 1, 1, 2, 2, 0, 2])
    cap = receive_caps(24, 4)
    assert cap.tolist() == [6, 6, 6, 6]
    z = receive_quotas(count.reshape(4, 2).sum(axis=1) - cap)
    assert z[0].tolist() == [0, 4, 2, 4] and not z[1:].any()
    alloc = allocate(count, z, 2)
    assert alloc[0].tolist() == [2, 4, 0, 4] and alloc[1].tolist() == [4, 0, 2, 0]
    assert (alloc[2:] == np.diag(count[2:]) @ np.eye(4, dtype=int)[np.arange(2, 8) // 2]).all()
    assert alloc.sum(axis=0).tolist() == [6, 6, 6, 6] and (alloc.sum(axis=1) == count).all()


def test_a_sender_may_send_past_its_excess_and_then_receive() -> None:
    """balance [3, 1, -4]: rank 0 (3) gives rank 2 its whole deficit 4, going to -1; then rank 1 (1) fills
    rank 0's deficit: every receiver has exactly one sender."""
    z = receive_quotas(np.array([3, 1, -4]))
    assert z.tolist() == [[0, 0, 4], [1, 0, 0], [0, 0, 0]]


def test_caps_split_the_remainder_over_the_first_ranks() -> None:
    assert receive_caps(10, 4).tolist() == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="sums to"):
        receive_quotas(np.array([1, 0]))


@pytest.mark.parametrize(("nodes", "gpn", "domain"), [(2, 4, None), (2, 4, 8), (4, 2, 4)])
def test_plan_invariants_and_perfect_balance(nodes: int, gpn: int, domain: int | None) -> None:
    ctx = make_ctx(nodes=nodes, gpus_per_node=gpn, microbatches=3, samples=96, skew=0.3, nvl_domain=domain)
    planner = MoonEPPlanner(replica_slots=2)
    plan = planner.plan(ctx)
    check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=True)
    d = ctx.cluster.domain_gpus
    per_gpu = plan.assign.sum(axis=2)  # [Mb, L, G]
    for k in range(ctx.num_gpus // d):
        block = per_gpu[..., k * d : (k + 1) * d]
        assert (block.max(axis=-1) - block.min(axis=-1) <= 1).all()  # every GPU of a domain: the same tokens
    home = MegatronPlanner().plan(ctx).assign.sum(axis=2).max(axis=-1)
    assert (per_gpu.max(axis=-1) <= home).all() and (per_gpu.max(axis=-1) < home).any()
    assert plan.online is not None and plan.online.critical_path_s.shape == ctx.load.shape[:2]
    if domain is not None and domain > gpn:
        # Some copy crossed a node inside its domain (allowed), none a domain.
        reps = np.argwhere(plan.replicas >= 0)
        src = plan.home[reps[:, 1], plan.replicas[tuple(reps.T)]]
        assert (src // gpn != reps[:, 2] // gpn).any() and (src // d == reps[:, 2] // d).all()


def test_a_copy_outside_the_domain_is_refused() -> None:
    ctx = make_ctx(nodes=2, gpus_per_node=4, microbatches=2, samples=64, skew=0.3)
    plan = MoonEPPlanner(replica_slots=2).plan(ctx)
    m, layer, g, s = np.argwhere(plan.replicas >= 0)[0]
    e = plan.replicas[m, layer, g, s]
    far = (g + 4) % 8
    assign = plan.assign.copy()
    assign[m, layer, e, far] += assign[m, layer, e, g]
    assign[m, layer, e, g] = 0
    replicas = plan.replicas.copy()
    replicas[m, layer, far] = -1
    replicas[m, layer, far, 0] = e
    from dataclasses import replace

    with pytest.raises(PlanInvariantError, match="home node"):
        check_plan(replace(plan, assign=assign, replicas=replicas), ctx, replica_slots=2)


def test_too_few_slots_are_refused() -> None:
    ctx = make_ctx(nodes=1, gpus_per_node=4, num_experts=16, microbatches=1)
    planner = MoonEPPlanner(replica_slots=3)
    assert "planner.replica_slots=3" in planner.cluster_problems(16, ctx.cluster)[0]
    with pytest.raises(ValueError, match=r"model\.num_experts / G"):
        planner.plan(ctx)
    with pytest.raises(ValueError, match=r"planner\.redundant_slots"):
        MoonEPPlanner(redundant_slots=1)


def test_pricing_charges_the_critical_path() -> None:
    counts, workload, cluster, model, cost = tiny_setup()
    slow = simulate(
        MoonEPPlanner(critical_path_s=1e-3, replica_slots=2), counts, workload, cluster, model, cost
    )
    free = simulate(
        MoonEPPlanner(critical_path_s=0.0, replica_slots=2), counts, workload, cluster, model, cost
    )
    per_batch = 1e-3 * workload.num_microbatches * counts.num_layers / counts.num_batches
    assert slow.metrics["t_critical_path_s"] == pytest.approx(per_batch)
    assert slow.metrics["step_time_s"] - free.metrics["step_time_s"] == pytest.approx(per_batch)
    assert free.metrics["t_sync_exposed_s"] > 0.0


def test_entry_point_refuses_too_few_slots(capsys) -> None:
    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError

    c = cfg("planner=moonep", "planner.replica_slots=2", "cluster.nodes=1")  # 128 experts / 8 GPUs = 16
    with pytest.raises(ConfigError, match=r"planner\.replica_slots=2 is below model\.num_experts / G"):
        check_config(c)
    check_config(cfg("planner=moonep", "cluster.nodes=8"))
