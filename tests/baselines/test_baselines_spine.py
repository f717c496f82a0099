"""Megatron-LM and Balanced baselines."""

from __future__ import annotations

import numpy as np
import pytest

from baselines.balanced import BalancedBound
from baselines.megatron import MegatronPlanner
from relibra.invariants import check_plan
from tests.builders import tiny_context


@pytest.mark.parametrize(("nodes", "gpn", "experts"), [(1, 1, 4), (1, 4, 8), (2, 2, 8), (2, 4, 16)])
def test_megatron_static_home_only(nodes, gpn, experts):
    ctx = tiny_context(nodes=nodes, gpus_per_node=gpn, num_experts=experts)
    plan = MegatronPlanner().plan(ctx)
    g = nodes * gpn
    np.testing.assert_array_equal(
        plan.home, np.broadcast_to(np.arange(experts) // (experts // g), plan.home.shape)
    )
    onehot = np.arange(g) == plan.home[None, :, :, None]
    assert (plan.assign[~np.broadcast_to(onehot, plan.assign.shape)] == 0).all()
    np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)
    check_plan(plan, ctx, replica_slots=0)


def test_megatron_refuses_replica_slots():
    with pytest.raises(ValueError, match=r"planner\.replica_slots=2"):
        MegatronPlanner(replica_slots=2)


def test_balanced_compute_is_the_mean():
    ctx = tiny_context(nodes=2, gpus_per_node=2, num_experts=8)
    br = BalancedBound().bound(ctx)
    g = ctx.num_gpus
    want = ctx.cost.expert_time(ctx.load.sum(axis=-2)).sum(axis=-1) / g
    np.testing.assert_allclose(br.t_compute, want)
    assert np.allclose(br.t_compute_gpu, br.t_compute[..., None])
    mega = ctx.cost.moe(ctx.load, MegatronPlanner().plan(ctx).assign)
    assert (br.t_compute <= mega.t_compute + 1e-15).all()
    assert np.ptp(br.t_comm_gpu, axis=-1).max() < 1e-12  # uniform traffic: every GPU equally busy


def test_balanced_no_comm_on_one_gpu():
    ctx = tiny_context(nodes=1, gpus_per_node=1, num_experts=4)
    np.testing.assert_allclose(BalancedBound().bound(ctx).t_comm, 0.0)
