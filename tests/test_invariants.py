"""The plan invariant checker accepts valid plans and names each violated invariant."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from baselines.megatron import MegatronPlanner
from relibra.invariants import PlanInvariantError, check_plan, sample_loads
from relibra.plan_dump import check_plan_dump
from relibra.types import BatchPlan
from tests.builders import tiny_context


@pytest.fixture
def ctx():
    return tiny_context(nodes=2, gpus_per_node=2, num_experts=8)


@pytest.fixture
def plan(ctx) -> BatchPlan:
    return MegatronPlanner().plan(ctx)


def _move_tokens(plan: BatchPlan, m: int, l: int, e: int, dst: int, n: int = 1) -> BatchPlan:
    """Move n tokens of expert e from its home to GPU dst."""
    a = plan.assign.copy()
    h = int(plan.home[l, e])
    assert a[m, l, e, h] >= n
    a[m, l, e, h] -= n
    a[m, l, e, dst] += n
    return replace(plan, assign=a)


def _hot(plan: BatchPlan) -> tuple[int, int, int]:
    m, l, e = np.unravel_index(np.argmax(plan.assign.sum(-1)), plan.assign.shape[:3])
    return int(m), int(l), int(e)


def test_megatron_plan_passes(ctx, plan):
    check_plan(plan, ctx, replica_slots=0)


def test_sample_loads_matches_workload(ctx):
    got = sample_loads(ctx.counts, ctx.sample_gpu, ctx.sample_mb, ctx.num_microbatches, ctx.num_gpus)
    np.testing.assert_array_equal(got, ctx.load)
    assert got.sum() == ctx.counts.sum()


def _expect(invariant: str, plan: BatchPlan, ctx, **kw) -> None:
    kw.setdefault("replica_slots", 0)
    with pytest.raises(PlanInvariantError, match=f"\\[{invariant}\\]"):
        check_plan(plan, ctx, **kw)


def test_wrong_dtype(ctx, plan):
    _expect("dtype", replace(plan, assign=plan.assign.astype(np.int64)), ctx)


def test_wrong_shape(ctx, plan):
    _expect("shape", replace(plan, assign=plan.assign[:, :, :, :-1]), ctx)


def test_load_not_bincount(ctx, plan):
    load = plan.load.copy()
    load[0, 0, 0, 0] += 1
    _expect("load", replace(plan, load=load), ctx)


def test_sample_gpu_changed_without_load(ctx, plan):
    sg = plan.sample_gpu.copy()
    sg[0] = (sg[0] + 1) % ctx.num_gpus
    _expect("load", replace(plan, sample_gpu=sg), ctx)


def test_sample_gpu_range(ctx, plan):
    sg = plan.sample_gpu.copy()
    sg[0] = ctx.num_gpus
    _expect("sample_gpu range", replace(plan, sample_gpu=sg), ctx)


def test_token_conservation(ctx, plan):
    m, l, e = _hot(plan)
    a = plan.assign.copy()
    a[m, l, e, plan.home[l, e]] -= 1
    _expect("token conservation", replace(plan, assign=a), ctx)


def test_negative_assign(ctx, plan):
    m, l, e = _hot(plan)
    h = int(plan.home[l, e])
    other = (h + 1) % ctx.num_gpus
    a = plan.assign.copy()
    a[m, l, e, other] -= 1
    a[m, l, e, h] += 1
    _expect("assign >= 0", replace(plan, assign=a), ctx)


def test_home_balance(ctx, plan):
    home = plan.home.copy()
    home[0, 0] = (home[0, 0] + 1) % ctx.num_gpus
    # keep assign at the (new) home so only the balance is wrong
    fixed = replace(plan, home=home, assign=_home_only(plan.load, home, ctx.num_gpus))
    _expect("home balance", fixed, ctx)


def _home_only(load, home, g):
    from relibra.planners.protocols import home_assign

    return home_assign(load, home, g)


def test_home_range(ctx, plan):
    home = plan.home.copy()
    home[0, 0] = -1
    _expect("home range", replace(plan, home=home), ctx)


def test_replica_slots(ctx, plan):
    m, l, e = _hot(plan)
    h = int(plan.home[l, e])
    peer = h ^ 1  # same node (gpus_per_node=2)
    moved = _move_tokens(plan, m, l, e, peer)
    check_plan(moved, ctx, replica_slots=1)  # one replica fits one slot
    _expect("replica slots", moved, ctx, replica_slots=0)


def test_replicas_in_home_node(ctx, plan):
    m, l, e = _hot(plan)
    h = int(plan.home[l, e])
    far = (h + 2) % ctx.num_gpus  # other node
    moved = _move_tokens(plan, m, l, e, far)
    _expect("replicas in home node", moved, ctx, replica_slots=1)
    check_plan(moved, ctx, replica_slots=1, replicas_in_home_node=False)


def test_redundant_slots(ctx, plan):
    m, l, e = _hot(plan)
    h = int(plan.home[l, e])
    a = plan.assign.copy()
    # spread the hot expert over every GPU: far GPUs then compute E/G + 1 distinct experts
    for g in range(ctx.num_gpus):
        if g != h and a[m, l, e, h] > 1:
            a[m, l, e, h] -= 1
            a[m, l, e, g] += 1
    spread = replace(plan, assign=a)
    check_plan(spread, ctx, replica_slots=0, redundant_slots=1, replicas_in_home_node=False)
    _expect("replica slots", spread, ctx, replicas_in_home_node=False)


def test_redundant_limit(ctx, plan):
    l, m = 0, 0
    a = plan.assign.copy()
    g = 0
    for e in range(a.shape[2]):  # GPU 0 computes one token of every expert that has tokens
        h = int(plan.home[l, e])
        if h != g and a[m, l, e, h] > 0:
            a[m, l, e, h] -= 1
            a[m, l, e, g] += 1
    _expect("redundant slots", replace(plan, assign=a), ctx, redundant_slots=1, replicas_in_home_node=False)


def test_slot_contents(ctx, plan):
    m, l, e = _hot(plan)
    h = int(plan.home[l, e])
    moved = _move_tokens(plan, m, l, e, h ^ 1)
    mb, num_layers, _, g = plan.assign.shape
    empty = np.full((mb, num_layers, g, 1), -1, dtype=np.int32)
    _expect("slot contents", replace(moved, replicas=empty), ctx, replica_slots=1)
    listed = empty.copy()
    listed[m, l, h ^ 1, 0] = e
    check_plan(replace(moved, replicas=listed), ctx, replica_slots=1)


def _dump(ctx, plan, **meta_over):
    meta = {
        "planner": "megatron",
        "nodes": ctx.cluster.nodes,
        "gpus_per_node": ctx.cluster.gpus_per_node,
        "replica_slots": 0,
        "redundant_slots": 0,
        "num_experts": ctx.counts.shape[2],
        "num_layers": ctx.counts.shape[1],
        "top_k": 2,
        "trace": "synthetic",
    } | meta_over
    return {
        "home": plan.home[None],
        "sample_gpu": plan.sample_gpu,
        "sample_mb": ctx.sample_mb,
        "mb_batch": np.zeros(ctx.num_microbatches, dtype=np.int32),
        "load": plan.load,
        "assign": plan.assign,
        "meta": np.array(json.dumps(meta)),
    }


def test_plan_dump_roundtrip(ctx, plan, tmp_path):
    path = tmp_path / "plans.npz"
    np.savez(path, **_dump(ctx, plan))
    meta = check_plan_dump(path, counts=ctx.counts)
    assert meta["planner"] == "megatron"


def test_plan_dump_violations(ctx, plan):
    d = _dump(ctx, plan)
    with pytest.raises(PlanInvariantError, match=r"\[keys\]"):
        check_plan_dump({k: v for k, v in d.items() if k != "assign"})
    with pytest.raises(PlanInvariantError, match=r"\[meta\]"):
        check_plan_dump(d | {"meta": np.array("{not json")})
    with pytest.raises(PlanInvariantError, match=r"\[meta\]"):
        check_plan_dump(d | {"meta": np.array(json.dumps({"planner": "x"}))})
    bad = d["assign"].copy()
    bad[0, 0, 0, 0] += 1
    with pytest.raises(PlanInvariantError, match=r"\[token conservation\]"):
        check_plan_dump(d | {"assign": bad})
    counts = ctx.counts.copy()
    counts[0, 0, 0] += 1
    with pytest.raises(PlanInvariantError, match=r"\[load\]"):
        check_plan_dump(d, counts=counts)


def test_redundant_physical_slots(ctx, plan):
    l, g = 0, 0
    num_layers, num_experts = plan.home.shape
    red = np.full((num_layers, ctx.num_gpus, 3), -1, dtype=np.int32)
    others = [e for e in range(num_experts) if plan.home[l, e] != g]
    red[l, g, :2] = others[:2]  # a width of 3 is fine; two copies fit two redundant slots
    check_plan(replace(plan, redundant=red), ctx, replica_slots=0, redundant_slots=2)
    red[l, g, 2] = others[2]  # a third copy needs a third slot
    _expect("redundant slots", replace(plan, redundant=red), ctx, redundant_slots=2)


PLANNER_CONF = sorted(
    p.stem for p in (Path(__file__).resolve().parents[1] / "experiments" / "conf" / "planner").glob("*.yaml")
)


@pytest.mark.parametrize("name", PLANNER_CONF)
def test_every_configured_planner_keeps_the_invariants(name):
    """Every planner in experiments/conf/planner, run by the simulator with check_plans on a tiny case."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from relibra.simulator import Bound, SimOptions, simulate
    from tests.builders import tiny_setup

    conf_dir = Path(__file__).resolve().parents[1] / "experiments" / "conf"
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        conf = compose(config_name="config", overrides=[f"planner={name}"])  # as the entry point sees it
    planner = instantiate(conf.planner, _convert_="all")
    counts, workload, cluster, model, cost = tiny_setup(nodes=2, gpus_per_node=2, num_experts=8)
    res = simulate(
        planner, counts, workload, cluster, model, cost, SimOptions(check_plans=True, keep_plans=True)
    )
    assert res.metrics["step_time_s"] > 0
    assert len(res.plans) == (0 if isinstance(planner, Bound) else counts.num_batches)


def _reps(plan: BatchPlan) -> np.ndarray:
    assert plan.replicas is not None
    return plan.replicas.copy()


def _listed(ctx, plan, width: int = 2) -> tuple[BatchPlan, tuple[int, int, int, int]]:
    """The hot expert moved to the other GPU of its node, listed in that GPU's first replica slot."""
    m, l, e = _hot(plan)
    peer = int(plan.home[l, e]) ^ 1
    moved = _move_tokens(plan, m, l, e, peer)
    mb, num_layers, _, g = plan.assign.shape
    reps = np.full((mb, num_layers, g, width), -1, dtype=np.int32)
    reps[m, l, peer, 0] = e
    return replace(moved, replicas=reps), (m, l, peer, e)


def test_listed_replicas_pass(ctx, plan):
    listed, _ = _listed(ctx, plan)
    check_plan(listed, ctx, replica_slots=2)


def test_slot_capacity(ctx, plan):
    listed, _ = _listed(ctx, plan, width=2)
    _expect("slot capacity", listed, ctx, replica_slots=1)


def test_slot_range(ctx, plan):
    listed, (m, l, g, _) = _listed(ctx, plan)
    reps = _reps(listed)
    reps[m, l, g, 1] = plan.home.shape[1]  # one past the last expert
    _expect("slot range", replace(listed, replicas=reps), ctx, replica_slots=2)


def test_slot_duplicate(ctx, plan):
    listed, (m, l, g, e) = _listed(ctx, plan)
    reps = _reps(listed)
    reps[m, l, g, 1] = e
    _expect("slot duplicate", replace(listed, replicas=reps), ctx, replica_slots=2)
    own = int(np.flatnonzero(plan.home[l] == g)[0])
    reps[m, l, g, 1] = own  # a GPU's own home expert in its replica slot
    _expect("slot duplicate", replace(listed, replicas=reps), ctx, replica_slots=2)


def test_listed_replica_in_another_node(ctx, plan):
    listed, (m, l, g, _) = _listed(ctx, plan)
    reps = _reps(listed)
    reps[m, l, g, 1] = int(np.flatnonzero(plan.home[l] // 2 != g // 2)[0])  # listed, computes nothing
    _expect("replicas in home node", replace(listed, replicas=reps), ctx, replica_slots=2)
    check_plan(replace(listed, replicas=reps), ctx, replica_slots=2, replicas_in_home_node=False)


def test_redundant_copy_may_sit_in_another_node(ctx, plan):
    m, l, e = _hot(plan)
    far = (int(plan.home[l, e]) + 2) % ctx.num_gpus
    moved = _move_tokens(plan, m, l, e, far)
    red = np.full((plan.home.shape[0], ctx.num_gpus, 1), -1, dtype=np.int32)
    red[l, far, 0] = e
    # a permanent redundant copy is not a replica: the in-node rule does not apply to it
    check_plan(replace(moved, redundant=red), ctx, replica_slots=0, redundant_slots=1)
    _expect("replicas in home node", moved, ctx, replica_slots=1)


def test_negative_load():
    from relibra.invariants import check_counts

    assign = np.zeros((1, 1, 2, 2), dtype=np.int32)
    load = np.zeros((1, 1, 2, 2), dtype=np.int32)
    load[0, 0, 1, 0] = -1
    with pytest.raises(PlanInvariantError, match=r"\[load >= 0\]") as err:
        check_counts(assign, load)
    assert err.value.invariant == "load >= 0" and "load(0, 0, 1, 0)" in err.value.detail
