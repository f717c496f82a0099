"""LLEP against its source: the LPT spill plan, the adaptive switch, the memory bound, the invariants, the
entry point. Expected values are derived by hand from ``compute_llep_lpt_plan`` (comments give the steps)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baselines.llep import LlepPlanner, imbalance_ratio, lpt_plan
from relibra.invariants import PlanInvariantError, check_plan, check_token_capacity
from relibra.plan_dump import check_plan_dump
from relibra.simulator import simulate
from relibra.trace.format import RoutingTrace, save_trace
from tests.builders import file_cfg, make_ctx, tiny_setup


def test_spill_worked_example() -> None:
    """4 GPUs x 2 experts, counts [5000, 1000 | 1000, 1000 | 500, 500 | 500, 500]: GPU loads 6000, 2000,
    1000, 1000 (ratio 2.4), capacity int(1.1 * 2500) = 2750. Expert 0 first: GPU 0's effective load is its
    pending 1000, so it keeps 1750; effective loads [2750, 2000, 1000, 1000] -> GPU 2 (tie with 3, lower id)
    takes 1750; then [2750, 2000, 2750, 1000] -> GPU 3 takes the last 1500. Everything else fits at home."""
    counts = np.array([5000, 1000, 1000, 1000, 500, 500, 500, 500])
    assert imbalance_ratio(counts, 4) == pytest.approx(2.4)
    plan = lpt_plan(counts, 4, 1.1, 1024)
    assert plan.capacity == 2750 and not plan.forced.any()
    assert plan.chunks.tolist() == [
        [0, 0, 1750], [0, 2, 1750], [0, 3, 1500], [1, 0, 1000], [2, 1, 1000], [3, 1, 1000],
        [4, 2, 500], [5, 2, 500], [6, 3, 500], [7, 3, 500],
    ]  # fmt: skip


def test_forced_spill_when_every_gpu_is_full() -> None:
    """3 GPUs x 1 expert, counts [9000, 100, 100], factor 1.0: capacity 9200 // 3 = 3066. Expert 0 keeps
    3066, GPUs 1 and 2 take 2966 each (their pending 100 reserved), 2 tokens are left with no room anywhere:
    forced onto the least-loaded other GPU (all tie at 3066 -> GPU 1). Expert 1 then finds 98 tokens of room
    at home and forces its last 2 onto GPU 0. Expert 2 fits at home."""
    plan = lpt_plan(np.array([9000, 100, 100]), 3, 1.0, 1024)
    assert plan.capacity == 3066
    assert plan.chunks.tolist() == [
        [0, 0, 3066], [0, 1, 2966], [0, 2, 2966], [0, 1, 2], [1, 1, 98], [1, 0, 2], [2, 2, 100]
    ]  # fmt: skip
    assert plan.forced.tolist() == [True, True, False]


def test_small_chunks_are_skipped_unless_last() -> None:
    """3 GPUs x 1 expert, counts [6000, 2100, 2100], factor 1.0, min 2000 tokens per GEMM: capacity 3400.
    Expert 0 keeps 3400; each helper has room 1300 < 2000 while 2600 remain, so both are skipped and the 2600
    are forced onto the least-loaded helper (GPU 1, tie broken by id). Expert 1 keeps its room of 800 and
    sends its last 1300 to GPU 2 (a last chunk is never skipped); expert 2 fits at home."""
    plan = lpt_plan(np.array([6000, 2100, 2100]), 3, 1.0, 2000)
    assert plan.capacity == 3400
    assert plan.chunks.tolist() == [[0, 0, 3400], [0, 1, 2600], [1, 1, 800], [1, 2, 1300], [2, 2, 2100]]
    assert plan.forced.tolist() == [False, True, False]


def test_adaptive_switch_keeps_balanced_layers_at_home() -> None:
    ctx = make_ctx(microbatches=2, samples=64, skew=50.0)  # nearly uniform routing
    plan = LlepPlanner().plan(ctx)
    assert plan.stats["llep_lpt_share"] == 0.0 and plan.stats["llep_weight_transfers_per_layer"] == 0.0
    assert LlepPlanner(routing_ratio=None).plan(ctx).stats["llep_lpt_share"] == 1.0


def test_plan_invariants_and_memory_bound() -> None:
    ctx = make_ctx(microbatches=3, samples=96, skew=0.3)
    planner = LlepPlanner(routing_ratio=None, min_tokens_per_gemm=16)
    plan = planner.plan(ctx)
    check_plan(plan, ctx, replica_slots=planner.replica_slots, replicas_in_home_node=False)
    assert plan.online is not None and plan.online.token_capacity is not None
    tokens = plan.assign.sum(axis=2)
    assert (tokens <= plan.online.token_capacity[..., None] | plan.online.over_capacity).all()
    # The capacity is LLEP's formula, computed here independently.
    total = ctx.load.sum(axis=(2, 3)).astype(np.int64)
    np.testing.assert_array_equal(
        plan.online.token_capacity, (1.1 * (total // ctx.num_gpus)).astype(np.int64)
    )
    # Spilled experts may leave their home node (no in-node invariant for LLEP).
    _, l_, e_, g_ = np.nonzero(plan.assign > 0)
    gpn = ctx.cluster.gpus_per_node
    assert (plan.home[l_, e_] // gpn != g_ // gpn).any()
    # Overloading a GPU the plan does not name breaks the bound.
    m, layer = 0, 0
    cap = int(plan.online.token_capacity[m, layer])
    g = int(np.argmin(tokens[m, layer]))
    assign = plan.assign.copy()
    donor = np.argwhere(assign[m, layer] > 0)
    moved = 0
    for e, src in donor:
        if src != g and tokens[m, layer, g] + moved <= cap:
            moved += int(assign[m, layer, e, src])
            assign[m, layer, e, g] += assign[m, layer, e, src]
            assign[m, layer, e, src] = 0
    assert tokens[m, layer, g] + moved > cap
    over = np.zeros_like(plan.online.over_capacity)
    with pytest.raises(PlanInvariantError, match="token capacity"):
        check_token_capacity(assign, plan.online.token_capacity, over)


def test_pricing_charges_copies_on_the_fabric() -> None:
    counts, workload, cluster, model, cost = tiny_setup()
    planner = LlepPlanner(routing_ratio=None, min_tokens_per_gemm=1, critical_path_s=0.0)
    res = simulate(planner, counts, workload, cluster, model, cost)
    assert res.metrics["t_critical_path_s"] == 0.0 and res.metrics["t_sync_exposed_s"] > 0.0
    slow = simulate(replace(planner, critical_path_s=1e-3), counts, workload, cluster, model, cost)
    per_batch = 1e-3 * workload.num_microbatches * counts.num_layers / counts.num_batches
    assert slow.metrics["step_time_s"] - res.metrics["step_time_s"] == pytest.approx(per_batch)


def test_fabric_copy_time_matches_nvlink_refill_inside_a_node() -> None:
    _, _, _, _, cost = tiny_setup(nodes=2, gpus_per_node=2, num_experts=8)
    home = np.repeat(np.arange(4), 2)[None]  # [1, 8]
    inside = np.array([[[[2], [-1], [6], [-1]]]])  # [1, L=1, G=4, r=1]: copies within each node
    assert cost.fabric_copy_time(inside, home) == pytest.approx(cost.replica_refill_time(inside, home))
    across = np.array([[[[-1], [-1], [0], [-1]]]])  # GPU 2 (node 1) copies expert 0 from GPU 0 (node 0)
    nic = cost.expert_weight_bytes() / (
        cost.cluster.hardware.nic_bytes_per_s * cost.cluster.hardware.nic_efficiency
    )
    assert cost.fabric_copy_time(across, home)[0, 0] == pytest.approx(nic)


def test_entry_point_and_plan_dump(tmp_path) -> None:
    from experiments.run import run

    rng = np.random.default_rng(4)
    lens = rng.integers(30, 200, size=16)
    scores = rng.gumbel(size=(int(lens.sum()), 16, 64)) - 2 * np.log(np.arange(1, 65))
    trace = RoutingTrace(
        experts=np.argsort(-scores, axis=-1)[..., :8].astype(np.int16),
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=np.array([0, 8, 16], dtype=np.int64),
        meta={"num_experts": 64, "top_k": 8, "num_layers": 16, "model": "olmoe", "source": "test"},
    )
    path = save_trace(trace, tmp_path / "t.npz")
    c = file_cfg(path, "planner=llep", "planner.min_tokens_per_gemm=1", "dump_plans=true",
                 "simulator.check_plans=true")  # fmt: skip
    row = run(c, run_dir=tmp_path / "run").iloc[0]
    assert row["planner"] == "llep" and row["t_critical_path_s"] > 0 and row["llep_lpt_share"] > 0
    meta = check_plan_dump(tmp_path / "run" / "plans.npz", counts=trace.to_counts().counts)
    assert meta["planner"] == "llep" and not meta["replicas_in_home_node"] and meta["replica_slots"] >= 1
