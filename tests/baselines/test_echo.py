"""ECHO (NVIDIA/Megatron-LM pull request #2368, docs/online_baselines.md "ECHO"): its spill and spare
capacities, the approximate bin packing and the one-shot greedy on hand-derived cases, a case where it must
clone and two where it must not, the plan invariants (tokens conserved, every assignment on a GPU holding the
expert, the slot bound, clones across nodes) on fixed and random loads, its pricing terms, and the
refusals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baselines.echo import NUM_BUCKETS, EchoPlanner, _plan_layer, offload_plan, spill_and_spare
from baselines.megatron import MegatronPlanner
from relibra.invariants import PlanInvariantError, check_plan
from relibra.simulator import SimOptions, simulate
from tests.builders import cfg, make_ctx, tiny_setup


def layer(x: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """One (micro-batch, layer) of the planner: x [G, E] -> (assign [E, G], replicas [G, slots])."""
    return _plan_layer(np.ascontiguousarray(x, dtype=np.int64), slots, NUM_BUCKETS)  # type: ignore[no-any-return]


def test_spill_keeps_the_least_loaded_experts_home() -> None:
    """4 GPUs of 2 experts, tokens [30, 10 | 2, 2 | 2, 2 | 1, 1]: total 50, avg 12. GPU 0 keeps expert 1
    (10, the less loaded) and 2 of expert 0; expert 0 spills 28. GPUs 1-3 offer 8, 8, 10."""
    spill, spare, avg = spill_and_spare(np.array([30, 10, 2, 2, 2, 2, 1, 1]), 4)
    assert avg == 12 and spill.tolist() == [28, 0, 0, 0, 0, 0, 0, 0] and spare.tolist() == [0, 8, 8, 10]


def test_bin_packing_worked_example() -> None:
    """One slot per GPU (the approximate bin packing), the case above: buckets of avg // 7 = 1 token. GPU 3
    (10, the roomiest) takes 10 of expert 0 (bucket 0: 28 >= 12); 18 left, bucket 0 again; GPU 1 takes 8;
    10 left, bucket (12 - 10) // 1 + 1 = 3; GPU 2 searches buckets 0-2 (empty) and takes 8 from bucket 3.
    GPU 0 ends at 14, the others at 12."""
    plan = offload_plan(np.array([30, 10, 2, 2, 2, 2, 1, 1]), 4, 1)
    assert plan.slot_expert[:, 0].tolist() == [-1, 0, 0, 0]
    assert plan.slot_tokens[:, 0].tolist() == [0, 8, 8, 10]
    x = np.zeros((4, 8), np.int64)
    x[:, :] = [30, 10, 2, 2, 2, 2, 1, 1]
    x[1:] = 0
    a, rep = layer(x, 1)
    assert a.sum(axis=0).tolist() == [14, 12, 12, 12] and rep[:, 0].tolist() == [-1, 0, 0, 0]


def test_bin_packing_returns_a_remainder_to_its_bucket() -> None:
    """5 GPUs of one expert, tokens [40, 30, 5, 3, 2]: avg 16, spills 24 and 14, spares 11, 13, 14 (GPUs 2-4),
    buckets of 16 // 7 = 2. GPU 4 takes 14 of expert 0 (bucket 0; 10 left -> bucket 4); GPU 3 finds bucket 0
    empty and takes 13 of expert 1 from bucket 2 (1 left -> bucket 7); GPU 2 searches on from bucket 2 and
    takes expert 0's last 10 from bucket 4. Expert 1's last token stays home."""
    plan = offload_plan(np.array([40, 30, 5, 3, 2]), 5, 1)
    assert plan.slot_expert[:, 0].tolist() == [-1, -1, 0, 1, 0]
    assert plan.slot_tokens[:, 0].tolist() == [0, 0, 10, 13, 14]


def test_one_shot_greedy_keeps_the_largest_overlaps() -> None:
    """3 GPUs of 6 experts, GPU 0 [2] * 6, GPU 2 [6, 0, ...]: total 18, avg 6. GPU 0 keeps three experts and
    spills 2 of each of experts 3, 4, 5; GPU 1's spare 6 overlaps all three chunks, and with two slots keeps
    the two largest (ties: the earlier chunk), so expert 5's 2 tokens stay home; with three slots all move."""
    counts = np.array([2] * 6 + [0] * 6 + [6] + [0] * 5)
    two = offload_plan(counts, 3, 2)
    assert two.spill[:6].tolist() == [0, 0, 0, 2, 2, 2] and two.spare.tolist() == [0, 6, 0]
    assert two.slot_expert[1].tolist() == [3, 4] and two.slot_tokens[1].tolist() == [2, 2]
    assert (two.slot_expert[[0, 2]] == -1).all()
    three = offload_plan(counts, 3, 3)
    assert sorted(three.slot_expert[1].tolist()) == [3, 4, 5] and three.slot_tokens[1].sum() == 6


def test_must_clone_a_hot_expert() -> None:
    """A hot expert on GPU 0 (2 nodes of 2 GPUs): ECHO clones it into the spare slots of the other GPUs,
    across the node too, and the busiest GPU computes less than without clones."""
    x = np.zeros((4, 8), np.int64)
    x[:, 0] = 50  # every source sends 50 tokens to expert 0 (home: GPU 0)
    x[:, 1:] = 5
    a, rep = layer(x, 2)
    static = np.bincount(np.arange(8) // 2, weights=x.sum(axis=0), minlength=4)
    assert a.sum(axis=0).max() < static.max()
    assert set(rep[2:, :].ravel().tolist()) >= {0}  # clones on node 1 (GPUs 2, 3)
    assert (a.sum(axis=1) == x.sum(axis=0)).all()


@pytest.mark.parametrize(
    ("per_expert", "why"),
    [
        ([20, 4, 12, 12, 1, 23, 6, 18], "every GPU at the average (24), however skewed its experts"),
        ([13, 0, 6, 6, 6, 6, 6, 6], "GPU 0 one over avg 12, no GPU below it: the floor leaves no spare"),
    ],
)
def test_must_not_clone(per_expert: list[int], why: str) -> None:
    x = np.zeros((4, 8), np.int64)
    x[0] = per_expert
    a, rep = layer(x, 2)
    assert (rep == -1).all(), why
    home = np.arange(8) // 2
    assert (a[np.arange(8), home] == x.sum(axis=0)).all() and a.sum() == x.sum()


@pytest.mark.parametrize(("nodes", "gpn", "slots"), [(2, 4, 1), (2, 4, 2), (4, 2, 3)])
def test_plan_invariants_and_balance(nodes: int, gpn: int, slots: int) -> None:
    """The shared checker (tokens conserved, every assignment on a GPU holding the expert, slots listing
    exactly the guests, at most ``slots`` of them), with clones leaving the node; never busier than
    without clones."""
    ctx = make_ctx(nodes=nodes, gpus_per_node=gpn, microbatches=3, samples=96, skew=0.3)
    plan = EchoPlanner(replica_slots=slots).plan(ctx)
    check_plan(plan, ctx, replica_slots=slots, replicas_in_home_node=False)
    assert plan.replicas is not None and plan.replicas.shape[-1] == slots
    ours = plan.assign.sum(axis=2).max(axis=-1)
    home = MegatronPlanner().plan(ctx).assign.sum(axis=2).max(axis=-1)
    assert (ours <= home).all() and (ours < home).any()
    _, layer_, g, _ = np.argwhere(plan.replicas >= 0).T
    src = plan.home[layer_, plan.replicas[plan.replicas >= 0]]
    assert (src // gpn != g // gpn).any()  # some clone crosses nodes
    with pytest.raises(PlanInvariantError):
        check_plan(plan, ctx, replica_slots=slots, replicas_in_home_node=True)
    if (plan.replicas >= 0).sum(axis=-1).max() == slots:
        with pytest.raises(PlanInvariantError, match="slot capacity"):
            check_plan(plan, ctx, replica_slots=slots - 1, replicas_in_home_node=False)


@settings(max_examples=80, deadline=None)
@given(
    g=st.sampled_from([2, 3, 4, 8]),
    per_gpu=st.integers(1, 4),
    slots=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_layers(g: int, per_gpu: int, slots: int, seed: int) -> None:
    """Any loads: every expert's tokens computed once, a clone only on a GPU that was below the average and
    only of an expert whose home was above it, at most ``slots`` clones per GPU listed exactly, and no GPU
    busier than the busiest without clones nor a clone's GPU pushed above the average."""
    num_experts = g * per_gpu
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 60, size=(g, num_experts)) * (rng.random((g, num_experts)) < 0.5)
    x[:, rng.integers(num_experts)] += rng.integers(0, 200)
    a, rep = layer(x, slots)
    counts = x.sum(axis=0)
    home = np.arange(num_experts) // per_gpu
    static = np.bincount(home, weights=counts, minlength=g)
    avg = int(counts.sum()) // g
    assert (a >= 0).all() and (a.sum(axis=1) == counts).all()
    for gpu in range(g):
        guests = {int(e) for e in np.nonzero(a[:, gpu])[0] if home[e] != gpu}
        listed = [int(e) for e in rep[gpu] if e >= 0]
        assert guests == set(listed) and len(listed) == len(set(listed)) <= slots
        if listed:
            assert static[gpu] < avg and a[:, gpu].sum() <= avg
            assert all(static[home[e]] > avg for e in listed)
    assert a.sum(axis=0).max() <= static.max()


def test_pricing_terms() -> None:
    """The terms LLEP and UltraEP pay: planning on the critical path per (micro-batch, layer); the clones'
    weights from their homes over the fabric and their gradients home, each in full and not hidden (a third
    pass with ``recompute_expert_dispatch``)."""
    counts, workload, cluster, model, cost = tiny_setup()
    per_layer = workload.num_microbatches * counts.num_layers / counts.num_batches
    slow = simulate(EchoPlanner(critical_path_s=1e-3), counts, workload, cluster, model, cost).metrics
    free = simulate(EchoPlanner(critical_path_s=0.0), counts, workload, cluster, model, cost).metrics
    assert slow["t_critical_path_s"] == pytest.approx(1e-3 * per_layer) and free["t_critical_path_s"] == 0.0
    assert slow["step_time_s"] - free["step_time_s"] == pytest.approx(1e-3 * per_layer)
    terms = ["t_compute_s", "t_comm_s", "t_sync_exposed_s", "t_reorder_s", "t_attention_s"]
    terms.append("t_critical_path_s")
    assert sum(slow[t] for t in terms) == pytest.approx(slow["step_time_s"])
    for recompute, passes in ((False, 2), (True, 3)):
        planner = EchoPlanner(recompute_expert_dispatch=recompute)
        res = simulate(planner, counts, workload, cluster, model, cost, SimOptions(keep_plans=True))
        replicas = [p.replicas for p in res.plans]
        assert all(r is not None for r in replicas)
        fill = np.concatenate([cost.fabric_copy_time(r, p.home) for r, p in zip(replicas, res.plans)])  # type: ignore[arg-type]
        assert (fill > 0).any()
        np.testing.assert_allclose(res.t_sync_exposed, passes * fill)
        assert all(p.online is not None and not p.online.overlapped_gradient_reduce for p in res.plans)
    megatron = simulate(MegatronPlanner(), counts, workload, cluster, model, cost).metrics
    assert megatron["t_sync_exposed_s"] == 0.0


def test_refusals() -> None:
    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError

    with pytest.raises(ValueError, match=r"planner\.replica_slots=0"):
        EchoPlanner(replica_slots=0)
    with pytest.raises(ValueError, match=r"planner\.redundant_slots=1"):
        EchoPlanner(redundant_slots=1)
    with pytest.raises(ValueError, match=r"planner\.critical_path_s=-1"):
        EchoPlanner(critical_path_s=-1.0)
    with pytest.raises(ConfigError, match=r"planner\.replica_slots=200 exceeds model\.num_experts=128"):
        check_config(cfg("planner=echo", "planner.replica_slots=200"))
    check_config(cfg("planner=echo", "cluster.nodes=2"))


REPO = Path(__file__).resolve().parents[2]


def test_cli_refuses_bad_slots_exit_2_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "model=olmoe-1b-7b", "trace.num_batches=1",
         "trace.samples_per_batch=8", "trace.max_tokens=64", "planner=echo", "planner.replica_slots=0",
         "logger=none", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "planner.replica_slots=0" in lines[0]
    assert not (tmp_path / "run" / "results.parquet").exists()
