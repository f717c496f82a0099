"""ForeMoE as this suite builds it from the paper's abstract (docs/baselines.md, "ForeMoE"): the two levels
of its planner on hand-derived cases, the plan invariants (copies may cross NVLink domains, slot bound,
token conservation) on fixed and random cases, the two-path transfer engine's pricing and the gradients'
return over the fabric, and the refusals before any work (exit 2, one line naming the key)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

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


def test_level_one_alone_skips_experts_the_receiver_cannot_hold() -> None:
    """Domains of one GPU (level 2 has nothing to even), experts 0-2 at home on GPU 0, expert 3 on GPU 1,
    tokens [2, 2, 2, 0]: total 6, mean 3. Move 1: the sender's hottest expert (0, the lowest of the ties)
    sends min(2, excess 3, deficit 3) = 2 to GPU 1, filling its one slot. Then excess 1, deficit 1, but GPU 1
    neither holds expert 1 or 2 nor has a slot: both are marked tried and level 1 stops at [4, 2]. With two
    slots the second move sends min(2, 1, 1) = 1 of expert 1: [3, 3]."""
    x = np.zeros((2, 4), np.int64)
    x[0, :3] = 2
    home = np.array([0, 0, 0, 1])
    a, rep = plan_layer(x, home, 1, 1)
    assert a.tolist() == [[0, 2], [2, 0], [2, 0], [0, 0]] and rep.tolist() == [[-1], [0]]
    a, rep = plan_layer(x, home, 1, 2)
    assert a.tolist() == [[0, 2], [1, 1], [2, 0], [0, 0]] and rep.tolist() == [[-1, -1], [0, 1]]


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
    slow_host = CostModel(replace(cluster, hardware=replace(HOPPER, host_to_device_bytes_per_s=10e9)), model)
    rep[0, 1, 0] = -1  # the host link slower than the NIC: the fabric carries the copy
    assert slow_host.engine_copy_time(rep, home)[0] == pytest.approx(slow_host.fabric_copy_time(rep, home)[0])
    no_host = CostModel(replace(cluster, hardware=replace(HOPPER, host_to_device_bytes_per_s=0.0)), model)
    with pytest.raises(ValueError, match=r"cluster\.hardware\.host_to_device_bytes_per_s=0"):
        no_host.engine_copy_time(rep, home)


def test_exposed_copies_by_hand() -> None:
    """Fill 3 s against a third of 6 s of attention, the gradient return 5 s against two thirds: 1 + 1 s
    exposed; the same links both ways is :meth:`exposed_refill`."""
    assert CostModel.exposed_copies(np.array(3.0), np.array(5.0), 6.0) == pytest.approx(2.0)
    assert CostModel.exposed_copies(np.array(5.0), np.array(5.0), 6.0) == CostModel.exposed_refill(
        np.array(5.0), 6.0
    )


def test_simulator_fills_by_the_engine_and_returns_gradients_over_the_fabric() -> None:
    """Across domains (2 nodes of 2 GPUs) the engine reads copies from host memory (53.6 GB/s above the
    NIC's 50 x 0.8): the forward fill is the engine's, the backward gradients go home over the NIC."""
    counts, workload, cluster, model, cost = tiny_setup()
    res = simulate(
        ForeMoEPlanner(replica_slots=2), counts, workload, cluster, model, cost, SimOptions(keep_plans=True)
    )
    fill = np.concatenate([cost.engine_copy_time(p.replicas, p.home) for p in res.plans])  # [M, L]
    back = np.concatenate([cost.fabric_copy_time(p.replicas, p.home) for p in res.plans])  # [M, L]
    np.testing.assert_allclose(res.t_sync_exposed, cost.exposed_copies(fill, back, res.t_layer_attention))
    assert res.metrics["t_critical_path_s"] == 0.0
    if cluster.num_domains > 1 and any((p.replicas >= 0).any() for p in res.plans):
        assert (back >= fill).all() and (back > fill).any()  # the NIC is slower than the host link here


@settings(max_examples=60, deadline=None)
@given(
    g_dom=st.sampled_from([(2, 1), (2, 2), (4, 2), (4, 4), (6, 2), (8, 4)]),
    per_gpu=st.integers(1, 3),
    slots=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
# Found by this test: level 1 once put a domain's whole move on one GPU (178 tokens, static max 156).
@example(g_dom=(6, 2), per_gpu=2, slots=1, seed=3197)
def test_random_layers_conserve_tokens_within_slots(
    g_dom: tuple[int, int], per_gpu: int, slots: int, seed: int
) -> None:
    """Any loads: every expert's tokens are computed once, a GPU computes at most ``slots`` non-home
    experts and lists exactly those in its slots, and no GPU ends busier than the busiest without copies."""
    g, domain = g_dom
    num_experts = g * per_gpu
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 40, size=(g, num_experts)) * (rng.random((g, num_experts)) < 0.6)
    home = np.repeat(np.arange(g), per_gpu)
    a, rep = plan_layer(x, home, domain, slots)
    assert (a >= 0).all() and (a.sum(axis=1) == x.sum(axis=0)).all()
    for gpu in range(g):
        guests = {int(e) for e in np.nonzero(a[:, gpu])[0] if home[e] != gpu}
        assert guests == {int(e) for e in rep[gpu] if e >= 0} and len(guests) <= slots
    static = np.bincount(home, weights=x.sum(axis=0), minlength=g)
    assert a.sum(axis=0).max() <= static.max()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), skew=st.floats(0.1, 2.0), slots=st.integers(0, 3))
def test_random_plans_pass_check_plan(seed: int, skew: float, slots: int) -> None:
    ctx = make_ctx(nodes=2, gpus_per_node=2, microbatches=2, samples=24, skew=skew, seed=seed)
    plan = ForeMoEPlanner(replica_slots=slots).plan(ctx)
    check_plan(plan, ctx, replica_slots=slots, replicas_in_home_node=False)


REPO = Path(__file__).resolve().parents[2]
TINY = ["model=olmoe-1b-7b", "trace.num_batches=1", "trace.samples_per_batch=8", "trace.max_tokens=64"]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("cluster.hardware.host_to_device_bytes_per_s=0", "cluster.hardware.host_to_device_bytes_per_s=0"),
        ("planner.replica_slots=-1", "planner.replica_slots=-1"),
        ("planner.redundant_slots=1", "planner.redundant_slots=1"),
    ],
)
def test_cli_refuses_bad_settings_exit_2_one_line(override: str, named: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY, "planner=foremoe", override, "logger=none",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and named in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "run" / "results.parquet").exists()  # nothing computed


def test_refusals() -> None:
    from experiments.config.checks import check_config
    from experiments.config.errors import ConfigError

    with pytest.raises(ValueError, match=r"planner\.redundant_slots"):
        ForeMoEPlanner(redundant_slots=1)
    with pytest.raises(ConfigError, match=r"cluster\.hardware\.host_to_device_bytes_per_s=0"):
        check_config(cfg("planner=foremoe", "cluster.hardware.host_to_device_bytes_per_s=0"))
    check_config(cfg("planner=foremoe", "cluster.nodes=2"))
