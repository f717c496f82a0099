"""UltraEP against its source: the quota solver, the per-rank split, the plan invariants, the pricing, the
entry point. Expected values are derived by hand from ``csrc/kernels/placement.cu`` (comments give the
steps)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baselines.megatron import MegatronPlanner
from baselines.ultraep import UltraEPPlanner, solve_domain, split_sources
from relibra.invariants import PlanInvariantError, check_plan
from relibra.plan_dump import check_plan_dump
from relibra.simulator import SimOptions, simulate
from tests.builders import file_cfg, make_ctx, tiny_setup


def test_fast_oracle_worked_example() -> None:
    """4 ranks x 1 expert, 1 slot each, loads [4000, 1000, 1000, 2000]. lo = ceil(8000 / 4) = 2000, the fast
    threshold ceil(2000 * 1.01) = 2020: rank 0 exports 1980. Feasible targets 1, 2, 3 -> floor ceil(1980/3)
    = 660; rank 3's slack 20 < 660, ranks 1 and 2 tie at 1020 -> rank 1 takes 1020. Then 2 targets -> floor
    480, rank 2 takes the last 960. The master keeps 4000 - 1980 = 2020."""
    sol = solve_domain(np.array([4000, 1000, 1000, 2000]), 1, 1)
    assert sol.threshold == 2020
    assert sol.host[0].tolist() == [0, 1, 2, -1] and sol.quota[0, :3].tolist() == [2020, 1020, 960]
    assert (sol.host[1:, 1:] == -1).all() and sol.quota[1:, 0].tolist() == [1000, 1000, 2000]
    assert sol.slots[:, 0].tolist() == [-1, 0, 0, -1]


def test_three_replicas_of_one_expert() -> None:
    """loads [9000, 1000, 1000, 1000]: T = ceil(3000 * 1.01) = 3030, excess 5970 over slack 3 x 2030; floors
    ceil(5970/3) = 1990, ceil(3940/2) = 1970, 1910 -> copies of 2030, 2030 and 1910 on ranks 1, 2, 3."""
    sol = solve_domain(np.array([9000, 1000, 1000, 1000]), 1, 1)
    assert sol.threshold == 3030
    assert sol.host[0].tolist() == [0, 1, 2, 3] and sol.quota[0].tolist() == [3030, 2030, 2030, 1910]


def test_one_slot_for_two_hot_ranks_gives_up() -> None:
    """loads [6000, 6000, 0], one slot per rank: at every threshold below 6000 both hot ranks need rank 2's
    only slot, so the fast tries (4040, 4100, 4160), the capacity bisection (4000) and the probes all fail and
    the search ends at hi = 6000: no copies at all. With two slots, rank 2 takes 1960 of each at T = 4040."""
    sol = solve_domain(np.array([6000, 6000, 0]), 1, 1)
    assert sol.threshold == 6000 and (sol.host[:, 1:] == -1).all()
    sol2 = solve_domain(np.array([6000, 6000, 0]), 1, 2)
    assert sol2.threshold == 4040
    assert (
        sol2.host[:2, :2].tolist() == [[0, 2], [1, 2]] and sol2.quota[:2, :2].tolist() == [[4040, 1960]] * 2
    )
    assert sol2.slots[2].tolist() == [0, 1]


def test_heaviest_expert_of_the_source_exports_first() -> None:
    """Two experts per rank, loads [3000, 2999 | 1, 0], one slot. Rank loads 5999 and 1; T = ceil(3000 *
    1.01) = 3030, so rank 0 must export 2969: its heaviest expert 0 (avail 3000 - 1 kept at home) sends 2969
    to rank 1 (floor 2969 / 1 target); expert 1 stays whole."""
    sol = solve_domain(np.array([3000, 2999, 1, 0]), 2, 1)
    assert sol.threshold == 3030
    assert sol.host[0, :2].tolist() == [0, 1] and sol.quota[0, :2].tolist() == [31, 2969]
    assert sol.quota[1, 0] == 2999 and sol.host[1, 1] == -1


def test_locality_aware_split() -> None:
    """Every rank holds [1000, 250, 250, 500] of the 4 experts; expert 0's copies (quotas 2020, 1020, 960 on
    ranks 0, 1, 2). Hosts keep their own tokens first: 1000, 1000, 960; room left 1020, 20, 0. Rank 2's other
    40 tokens split 1020:20 -> 39 + 1 (largest remainder: 800 > 240); rank 3's 1000 -> 981 + 19."""
    sol = solve_domain(np.array([4000, 1000, 1000, 2000]), 1, 1)
    alloc = split_sources(np.tile([1000, 250, 250, 500], (4, 1)), sol)
    assert alloc[:, 0, :3].tolist() == [[1000, 0, 0], [0, 1000, 0], [39, 1, 960], [981, 19, 0]]
    assert (alloc[:, 0, :3].sum(axis=0) == sol.quota[0, :3]).all()
    assert (alloc[:, 1:, 0] == np.tile([250, 250, 500], (4, 1))).all()
    plain = split_sources(np.tile([1000, 250, 250, 500], (4, 1)), sol, locality=False)
    assert plain[3, 0, :3].tolist() == [505, 255, 240]  # 1000 * (2020, 1020, 960) / 4000


@pytest.mark.parametrize("slots", [1, 2])
def test_plan_invariants_and_balance(slots: int) -> None:
    ctx = make_ctx(microbatches=3, samples=96, skew=0.3)
    planner = UltraEPPlanner(replica_slots=slots, min_tokens_per_replica=1)
    plan = planner.plan(ctx)
    check_plan(plan, ctx, replica_slots=slots, replicas_in_home_node=True)
    assert plan.replicas is not None and plan.replicas.shape[-1] == slots and (plan.replicas >= 0).any()
    assert plan.online is not None and plan.online.critical_path_s.shape == ctx.load.shape[:2]
    gpu_ultra = plan.assign.sum(axis=2).max(axis=-1)
    gpu_home = MegatronPlanner().plan(ctx).assign.sum(axis=2).max(axis=-1)
    assert (gpu_ultra <= gpu_home).all() and (gpu_ultra < gpu_home).any()
    assert ((plan.replicas >= 0).sum(axis=-1) == slots).any()  # some GPU fills its slots ...
    with pytest.raises(PlanInvariantError, match="slot capacity"):  # ... so a smaller bound is broken
        check_plan(plan, ctx, replica_slots=slots - 1)
    # A copy moved to another node breaks the NVLink-domain invariant.
    m, layer, g, s = np.argwhere(plan.replicas >= 0)[0]
    e = plan.replicas[m, layer, g, s]
    far = (g + ctx.cluster.gpus_per_node) % ctx.num_gpus
    assign = plan.assign.copy()
    assign[m, layer, e, far] += assign[m, layer, e, g]
    assign[m, layer, e, g] = 0
    replicas = plan.replicas.copy()
    replicas[m, layer, far] = -1
    replicas[m, layer, far, 0] = e
    with pytest.raises(PlanInvariantError, match="home node"):
        check_plan(replace(plan, assign=assign, replicas=replicas), ctx, replica_slots=slots)


def test_pricing_charges_the_critical_path() -> None:
    """Planning seconds are charged per (micro-batch, layer); the copies twice in full plus the gradient
    reduction's excess over the backward attention (cheap on NVLink here, so it hides)."""
    counts, workload, cluster, model, cost = tiny_setup()
    slow = simulate(UltraEPPlanner(critical_path_s=1e-3, min_tokens_per_replica=1), counts, workload, cluster,
                    model, cost).metrics  # fmt: skip
    free = simulate(UltraEPPlanner(critical_path_s=0.0, min_tokens_per_replica=1), counts, workload, cluster,
                    model, cost).metrics  # fmt: skip
    per_batch = 1e-3 * workload.num_microbatches * counts.num_layers / counts.num_batches
    assert slow["t_critical_path_s"] == pytest.approx(per_batch) and free["t_critical_path_s"] == 0.0
    assert slow["step_time_s"] - free["step_time_s"] == pytest.approx(per_batch)
    terms = (
        "t_compute_s",
        "t_comm_s",
        "t_sync_exposed_s",
        "t_reorder_s",
        "t_attention_s",
        "t_critical_path_s",
    )
    assert sum(slow[t] for t in terms) == pytest.approx(slow["step_time_s"])
    assert free["t_sync_exposed_s"] > 0.0
    res = simulate(UltraEPPlanner(min_tokens_per_replica=1), counts, workload, cluster, model, cost,
                   SimOptions(keep_plans=True))  # fmt: skip
    fill = np.concatenate([cost.fabric_copy_time(p.replicas, p.home) for p in res.plans])  # [M, L]
    want = 2 * fill + np.maximum(fill - 2 * res.t_layer_attention / 3, 0)
    np.testing.assert_allclose(res.t_sync_exposed, want)
    megatron = simulate(MegatronPlanner(), counts, workload, cluster, model, cost).metrics
    assert megatron["t_critical_path_s"] == 0.0


def test_entry_point_and_plan_dump(tmp_path) -> None:
    from experiments.run import run
    from relibra.trace.format import RoutingTrace, save_trace

    rng = np.random.default_rng(3)
    lens = rng.integers(30, 200, size=16)
    experts = np.argsort(-rng.gumbel(size=(int(lens.sum()), 16, 64)) - np.log(np.arange(1, 65)), axis=-1)
    trace = RoutingTrace(
        experts=experts[..., :8].astype(np.int16),
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=np.array([0, 8, 16], dtype=np.int64),
        meta={"num_experts": 64, "top_k": 8, "num_layers": 16, "model": "olmoe", "source": "test"},
    )
    path = save_trace(trace, tmp_path / "t.npz")
    c = file_cfg(path, "planner=ultraep", "planner.min_tokens_per_replica=1", "dump_plans=true",
                 "simulator.check_plans=true")  # fmt: skip
    row = run(c, run_dir=tmp_path / "run").iloc[0]
    assert row["planner"] == "ultraep" and row["t_critical_path_s"] > 0
    meta = check_plan_dump(tmp_path / "run" / "plans.npz", counts=trace.to_counts().counts)
    assert meta["planner"] == "ultraep" and meta["replica_slots"] == 2 and meta["replicas_in_home_node"]


def test_one_domain_of_two_nodes_copies_across_them() -> None:
    """``cluster.nvl_domain=8`` over 2 nodes of 4: one solver domain spans both nodes; copies cross them."""
    ctx = make_ctx(microbatches=3, samples=96, skew=0.3, nvl_domain=8)
    plan = UltraEPPlanner(replica_slots=2, min_tokens_per_replica=1).plan(ctx)
    check_plan(plan, ctx, replica_slots=2, replicas_in_home_node=True)
    m, layer, g, s = np.nonzero(plan.replicas >= 0)
    src = plan.home[layer, plan.replicas[m, layer, g, s]]
    assert (src // 4 != g // 4).any()
    narrow = UltraEPPlanner(replica_slots=2, min_tokens_per_replica=1).plan(
        make_ctx(microbatches=3, samples=96, skew=0.3)
    )
    assert plan.assign.sum(axis=2).max(axis=-1).sum() <= narrow.assign.sum(axis=2).max(axis=-1).sum()
