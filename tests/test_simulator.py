"""The simulator on tiny workloads: metrics add up, and each cost it charges matches the cost model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from unittest import mock

import numpy as np
import pytest

from baselines.balanced import BalancedBound
from baselines.megatron import MegatronPlanner
from relibra.cost import step
from relibra.cost.model import CostModel
from relibra.cost.pricing import skewness
from relibra.invariants import check_plan
from relibra.planners.protocols import BatchContext, Planner, SlotBudget, home_assign, static_placement
from relibra.simulator import METRIC_COLUMNS, Bound, CostModelExecutor, SimOptions, simulate
from relibra.types import BatchPlan
from tests.builders import tiny_setup, training_spec


@dataclass(frozen=True)
class SwapPlanner:
    """Swaps the homes of experts 0 and the last one in every layer from batch 1 on (a toy reorderer)."""

    name: str = "swap"
    slot_budget: SlotBudget = field(default_factory=SlotBudget)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        num_layers, num_experts = ctx.counts.shape[1:]
        home = static_placement(num_layers, num_experts, ctx.num_gpus).copy()
        if ctx.batch >= 1:
            home[:, [0, -1]] = home[:, [-1, 0]]
        return BatchPlan(
            home=home,
            assign=home_assign(ctx.load, home, ctx.num_gpus),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
        )


@dataclass(frozen=True)
class PeerReplicaPlanner:
    """Megatron placement; half of each layer's hottest expert computed on the home's node peer."""

    name: str = "peer"
    replica_slots: int = 1

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(replica_slots=self.replica_slots)

    def plan(self, ctx: BatchContext) -> BatchPlan:
        base = MegatronPlanner().plan(ctx)
        a = base.assign.copy()
        mb, num_layers = a.shape[:2]
        for m in range(mb):
            for l in range(num_layers):
                e = int(np.argmax(a[m, l].sum(-1)))
                h = int(base.home[l, e])
                half = a[m, l, e, h] // 2
                a[m, l, e, h] -= half
                a[m, l, e, h ^ 1] += half
        return BatchPlan(home=base.home, assign=a, load=base.load, sample_gpu=base.sample_gpu)


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(nodes=2, gpus_per_node=2, num_experts=8)


def test_planners_and_bounds_are_told_apart():
    assert isinstance(MegatronPlanner(), Planner) and not isinstance(MegatronPlanner(), Bound)
    assert isinstance(BalancedBound(), Bound) and not isinstance(BalancedBound(), Planner)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_whole_step_metrics_add_up(setup, recompute):
    """The update pass is the MoE-only step's parts plus permutation, recompute and the balance-independent
    part; the step is the sum of its passes."""
    counts, workload, cluster, model, _ = setup
    training = training_spec(recompute=recompute, rl_passes=("reference", "recompute", "update"))
    cost = CostModel(cluster, model, training=training)
    m = simulate(MegatronPlanner(), counts, workload, cluster, model, cost).metrics
    moe = m["t_compute_s"] + m["t_comm_s"] + m["t_sync_exposed_s"] + m["t_reorder_s"] + m["t_attention_s"]
    update = moe + m["t_critical_path_s"] + m["t_permute_s"] + m["t_recompute_s"] + m["t_other_s"]
    assert m["t_pass_update_s"] == pytest.approx(update, rel=1e-12)
    passes = m["t_pass_update_s"] + m["t_pass_recompute_s"] + m["t_pass_reference_s"]
    assert m["step_time_s"] == pytest.approx(passes, rel=1e-12)
    assert m["t_pass_reference_s"] > 0 and m["t_pass_recompute_s"] > 0 and m["t_other_s"] > 0
    assert (m["t_recompute_s"] > 0) == (recompute != "none")
    assert m["t_fp8_cast_s"] == 0.0  # bf16


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fp8_casts_join_the_update_and_the_forward_passes(setup, recompute):
    """With ``cluster.precision=fp8`` the update is the MoE-only parts plus permutation, the FP8 casts,
    recompute and the balance-independent part; a forward-only pass pays half of the casts (memory-bound),
    so turning the casts off (their bytes to 0) takes exactly ``t_fp8_cast_s`` off the update and half of it
    off each forward-only pass (no recompute: with full recompute the backward also repeats their forward;
    the gradient collectives are not overlapped, else they would hide part of the casts)."""
    counts, workload, cluster, model, _ = setup
    fp8 = replace(cluster, precision="fp8")
    training = training_spec(
        recompute=recompute,
        rl_passes=("recompute", "update"),
        fp8_recipe="tensorwise",
        overlap_grad_reduce=False,
        overlap_param_gather=False,
    )
    cost = CostModel(fp8, model, training=training)
    m = simulate(MegatronPlanner(), counts, workload, fp8, model, cost).metrics
    moe = m["t_compute_s"] + m["t_comm_s"] + m["t_sync_exposed_s"] + m["t_reorder_s"] + m["t_attention_s"]
    update = moe + m["t_critical_path_s"] + m["t_permute_s"] + m["t_fp8_cast_s"] + m["t_recompute_s"]
    assert m["t_fp8_cast_s"] > 0
    assert m["t_pass_update_s"] == pytest.approx(update + m["t_other_s"], rel=1e-12)
    if recompute == "none":
        with mock.patch.dict(step.FP8_CAST_BYTES, {"tensorwise": 0.0}):
            free = CostModel(fp8, model, training=training)
            n = simulate(MegatronPlanner(), counts, workload, fp8, model, free).metrics
        assert n["t_fp8_cast_s"] == 0.0
        assert m["t_pass_update_s"] - n["t_pass_update_s"] == pytest.approx(m["t_fp8_cast_s"], rel=1e-9)
        assert m["t_pass_recompute_s"] - n["t_pass_recompute_s"] == pytest.approx(
            0.5 * m["t_fp8_cast_s"], rel=1e-9
        )


def test_megatron_metrics_add_up(setup):
    counts, workload, cluster, model, cost = setup
    res = simulate(MegatronPlanner(), counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
    assert set(METRIC_COLUMNS) <= set(res.metrics)
    nb = counts.num_batches
    m = res.metrics
    parts = m["t_compute_s"] + m["t_comm_s"] + m["t_sync_exposed_s"] + m["t_reorder_s"] + m["t_attention_s"]
    assert m["step_time_s"] == pytest.approx(parts)
    assert m["step_time_s"] == pytest.approx(res.batch_time.sum() / nb)
    assert m["throughput_tokens_per_s"] == pytest.approx(counts.tokens.sum() / res.batch_time.sum())
    assert m["reorder_moved_experts"] == 0 and m["t_reorder_s"] == 0 and m["replica_buffer_bytes"] == 0
    assign = np.concatenate([p.assign for p in res.plans])
    np.testing.assert_allclose(res.skew, skewness(assign.sum(axis=-2)))
    assert m["skew_max"] == pytest.approx(res.skew.max()) and m["skew_mean"] >= 1.0
    br = cost.moe(np.concatenate([p.load for p in res.plans]), assign)
    np.testing.assert_allclose(res.t_compute, br.t_compute)
    np.testing.assert_allclose(res.t_comm, br.t_comm)
    table = res.per_layer()
    assert len(table) == workload.num_microbatches * counts.num_layers
    assert set(table["batch"]) == set(range(nb))


def test_plans_kept_only_when_asked(setup):
    counts, workload, cluster, model, cost = setup
    assert simulate(MegatronPlanner(), counts, workload, cluster, model, cost).plans == ()


def test_reordering_migration_charged(setup):
    counts, workload, cluster, model, cost = setup
    res = simulate(SwapPlanner(), counts, workload, cluster, model, cost)
    nb, num_layers = counts.num_batches, counts.num_layers
    assert res.metrics["reorder_moved_experts"] == pytest.approx(2 * num_layers / nb)
    g_first, g_last = 0, cluster.num_gpus - 1
    src = np.tile([g_first, g_last], num_layers)
    dst = np.tile([g_last, g_first], num_layers)
    # bf16 weight 2 + fp32 master weight 4 + two fp32 Adam moments 8 = 14 bytes per parameter, no gradient
    expert_bytes = 3 * model.hidden * model.moe_ffn * 14.0
    t = cost.transfer_time(src, dst, expert_bytes)
    assert t > 0
    assert res.metrics["t_reorder_s"] == pytest.approx(t / nb)
    assert res.metrics["migration_bytes"] == pytest.approx(2 * num_layers * expert_bytes / nb)


def test_distributed_optimizer_shards_the_migrated_state(setup):
    """With the optimizer state sharded over 4 expert-data-parallel ranks an EP group moves 2 + 12 / 4."""
    from relibra.cost.migration import MigrationPayload
    from relibra.cost.model import CostModel

    counts, workload, cluster, model, _ = setup
    payload = MigrationPayload(expert_data_parallel=4)
    assert payload.bytes_per_param == 5.0
    fp8 = MigrationPayload(weight_bytes=1.0, optimizer_state_bytes=4.0)
    assert fp8.bytes_per_param == 9.0
    cost = CostModel(cluster, model, migration=payload)
    res = simulate(SwapPlanner(), counts, workload, cluster, model, cost)
    want = 2 * counts.num_layers * 3 * model.hidden * model.moe_ffn * 5.0 / counts.num_batches
    assert res.metrics["migration_bytes"] == pytest.approx(want)
    with pytest.raises(ValueError, match=r"parallel\.dp"):
        MigrationPayload(expert_data_parallel=0)


def test_replica_refill_exposed(setup):
    counts, workload, cluster, model, cost = setup
    res = simulate(PeerReplicaPlanner(), counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
    assert res.metrics["replica_buffer_bytes"] == cost.expert_weight_bytes()
    # one replica per receiving GPU, sent by its home: the refill is one expert over NVLink
    refill = cost.expert_weight_bytes() / (
        cluster.hardware.nvlink_bytes_per_s * cluster.hardware.nvlink_efficiency
    )
    attn = res.t_layer_attention
    want = np.maximum(refill - attn / 3, 0) + np.maximum(refill - 2 * attn / 3, 0)
    np.testing.assert_allclose(res.t_sync_exposed, want)
    mega = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    assert res.metrics["skew_mean"] < mega.metrics["skew_mean"]


def test_balanced_is_a_lower_bound(setup):
    counts, workload, cluster, model, cost = setup
    bal = simulate(BalancedBound(), counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
    mega = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    assert bal.plans == ()
    assert bal.metrics["skew_max"] == 1.0
    assert bal.metrics["t_compute_s"] <= mega.metrics["t_compute_s"]
    assert bal.metrics["step_time_s"] < mega.metrics["step_time_s"]
    assert bal.metrics["t_comm_s"] <= mega.metrics["t_comm_s"]
    # attention at its mean over GPUs: never above the busiest GPU's of the real layout
    assert bal.metrics["t_attention_s"] <= mega.metrics["t_attention_s"]
    assert bal.metrics["reorder_moved_experts"] == 0.0 and bal.metrics["migration_bytes"] == 0.0


def test_cost_model_executor(setup):
    counts, workload, cluster, model, cost = setup
    res = simulate(MegatronPlanner(), counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
    report = CostModelExecutor(cost).execute(res.plans, model, cluster)
    np.testing.assert_allclose(report.moe_time_s, res.t_compute + res.t_comm)


def test_contexts_are_valid_for_the_checker(setup):
    counts, workload, cluster, model, cost = setup
    from relibra.simulator import batch_context

    for b in range(counts.num_batches):
        ctx = batch_context(counts, workload, b, cluster, model, cost)
        check_plan(MegatronPlanner().plan(ctx), ctx, replica_slots=0)
        assert ctx.regroup is not None
        load, tokens = ctx.regroup(ctx.sample_gpu)
        np.testing.assert_array_equal(load, ctx.load)
        assert tokens.sum() == ctx.sample_tokens.sum()


def test_check_plans_option(setup):
    from relibra.invariants import PlanInvariantError

    counts, workload, cluster, model, cost = setup
    opts = SimOptions(check_plans=True)
    simulate(PeerReplicaPlanner(), counts, workload, cluster, model, cost, opts)
    with pytest.raises(PlanInvariantError, match=r"\[replica slots\]"):
        simulate(PeerReplicaPlanner(replica_slots=0), counts, workload, cluster, model, cost, opts)


def test_balanced_bounds_planners_under_deepep():
    from dataclasses import replace

    from relibra.cost.model import CostModel
    from relibra.planners.compose import relibra

    counts, workload, cluster, model, _ = tiny_setup(nodes=2, gpus_per_node=2, num_experts=8)
    cluster = replace(cluster, dispatcher="deepep")
    cost = CostModel(cluster, model)
    bal = simulate(BalancedBound(), counts, workload, cluster, model, cost)
    for planner in (MegatronPlanner(), relibra(replica_slots=1)):
        res = simulate(planner, counts, workload, cluster, model, cost)
        assert bal.metrics["step_time_s"] <= res.metrics["step_time_s"], planner
        assert bal.metrics["t_comm_s"] <= res.metrics["t_comm_s"] * (1 + 1e-9), planner
