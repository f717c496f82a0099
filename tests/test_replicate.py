"""Greedy replication: plan invariants, water-filling, rounding, compiled comm vs the cost model, buffer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost import CostModel
from relibra.invariants import check_assignment
from relibra.planner import home_assign, static_placement
from relibra.planners.replicate import (
    ReplicationCoefficients,
    _comm_per_gpu,
    linear_objective,
    replicate_greedy,
    round_assign,
)
from relibra.replica_buffer import (
    PAPER_BUFFER_MIB,
    buffer_footprint,
    per_gpu_parameter_bytes,
    replica_buffer_bytes,
)
from tests.spine_helpers import HOPPER

MODEL = ModelSpec("test-moe", 4, 4, 2048, 768, 64, 8, 16, 4, 128)


def _cost(nodes: int, gpus_per_node: int, model: ModelSpec = MODEL) -> CostModel:
    return CostModel(ClusterSpec(nodes, gpus_per_node, HOPPER), model)


def _skewed_loads(rng: np.random.Generator, problems: int, g: int, e: int, tokens: int = 512) -> np.ndarray:
    """int32 [P, G, E]: Dirichlet(0.5) expert popularity per problem, multinomial per source GPU."""
    p = rng.dirichlet(np.full(e, 0.5), size=problems)
    return np.stack([rng.multinomial(tokens * 8, p[i], size=g) for i in range(problems)]).astype(np.int32)


def _compute(assign: np.ndarray) -> np.ndarray:
    return assign.sum(axis=-2).astype(np.float64)


@pytest.mark.parametrize(("nodes", "gpn", "r"), [(1, 8, 1), (1, 8, 2), (2, 4, 2), (4, 2, 4)])
def test_greedy_plans_satisfy_invariants(nodes: int, gpn: int, r: int) -> None:
    rng = np.random.default_rng(nodes * 10 + r)
    cost = _cost(nodes, gpn)
    g, e = nodes * gpn, MODEL.num_experts
    load = _skewed_loads(rng, 6, g, e)
    home = np.stack([rng.permutation(static_placement(1, e, g)[0]) for _ in range(6)])
    rep = replicate_greedy(load, home, cost, r)
    assert rep.assign.dtype == np.int32 and rep.replicas.dtype == np.int32
    assert rep.assign.shape == (6, e, g) and rep.replicas.shape == (6, g, r)
    # the six problems as six layers of one micro-batch
    check_assignment(
        home,
        rep.assign[None],
        load[None],
        gpus_per_node=gpn,
        replica_slots=r,
        replicas_in_home_node=True,
        replicas=rep.replicas[None],
    )
    tot = load.sum(axis=1)
    np.testing.assert_array_equal(rep.assign.sum(axis=-1), tot)
    share = rep.assign / np.maximum(tot, 1)[..., None]
    assert share.min() >= 0.0 and share.max() <= 1.0
    # every listed replica holds tokens and is not at home; every non-home copy is listed
    listed = np.zeros((6, e, g), dtype=bool)
    p_i, g_i, s_i = np.nonzero(rep.replicas >= 0)
    listed[p_i, rep.replicas[p_i, g_i, s_i], g_i] = True
    non_home = (rep.assign > 0) & (np.arange(g) != home[..., None])
    np.testing.assert_array_equal(listed, non_home)


def test_no_slots_is_home_only() -> None:
    rng = np.random.default_rng(1)
    cost = _cost(1, 8)
    load = _skewed_loads(rng, 3, 8, 64)
    home = np.broadcast_to(static_placement(1, 64, 8)[0], (3, 64))
    rep = replicate_greedy(load, home, cost, 0)
    np.testing.assert_array_equal(rep.assign, home_assign(load, home, 8))
    assert rep.replicas.shape == (3, 8, 0)


@pytest.mark.parametrize("acceptance", ["best", "comm", "compute"])
def test_greedy_improves_skewed_single_node(acceptance: str) -> None:
    rng = np.random.default_rng(2)
    cost = _cost(1, 8)
    load = _skewed_loads(rng, 8, 8, 64, tokens=2048)
    home = np.broadcast_to(static_placement(1, 64, 8)[0], (8, 64))
    base = home_assign(load, home, 8)
    rep = replicate_greedy(load, home, cost, 2, acceptance=acceptance)  # type: ignore[arg-type]
    before = linear_objective(load, base, home, cost)
    after = linear_objective(load, rep.assign, home, cost)
    assert np.all(after <= before * (1 + 1e-9))
    skew = _compute(rep.assign).max(-1) / _compute(rep.assign).mean(-1)
    skew0 = _compute(base).max(-1) / _compute(base).mean(-1)
    assert skew.mean() < skew0.mean()
    assert np.all(skew < 1.2)  # 8 GPUs x 2 slots relieve a Dirichlet(0.5) layer almost completely


def test_waterfill_levels_copies_of_one_hot_expert() -> None:
    """One hot expert on GPU 0 of a 4-GPU node, r = 3: its copies end at one level (closed form)."""
    cost = _cost(1, 4)
    h = ReplicationCoefficients.from_cost(cost).fixed_tokens
    e = 8
    load = np.zeros((4, e), dtype=np.int32)
    load[:, 0] = 4000  # expert 0 (home GPU 0): 16000 tokens
    load[:, 1:] = 100  # the others: 400 tokens each
    home = static_placement(1, e, 4)[0]
    rep = replicate_greedy(load, home, cost, 3, acceptance="compute")
    comp = rep.assign.sum(0) + h * ((rep.assign > 0) | (np.arange(4) == home[:, None])).sum(0)
    assert (rep.replicas >= 0).sum() == 3  # all three peers hold a copy of expert 0
    assert set(rep.replicas[rep.replicas >= 0].tolist()) == {0}
    assert comp.max() - comp.min() <= 1.0  # one level, up to the integer rounding


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.floats(0, 50), min_size=4, max_size=4), min_size=1, max_size=6),
    st.integers(0, 3),
)
def test_round_assign_keeps_totals_and_zeros(rows: list[list[float]], seed: int) -> None:
    a = np.array(rows)
    rng = np.random.default_rng(seed)
    a[rng.random(a.shape) < 0.3] = 0.0
    tot = np.round(a.sum(-1)).astype(np.int64)
    out = round_assign(a, tot)
    np.testing.assert_array_equal(out.sum(-1), np.where(a.sum(-1) > 0, tot, 0))
    assert np.all(out[a == 0] == 0)
    assert np.all(
        np.abs(out - a * np.divide(tot, a.sum(-1), out=np.zeros(len(a)), where=a.sum(-1) > 0)[:, None]) < 1
    )


@pytest.mark.parametrize(("nodes", "gpn"), [(1, 4), (2, 4), (4, 2)])
def test_compiled_comm_matches_cost_model(nodes: int, gpn: int) -> None:
    rng = np.random.default_rng(nodes)
    cost = _cost(nodes, gpn)
    g = nodes * gpn
    traffic = rng.integers(0, 1000, size=(g, g)).astype(np.float64)
    coef = ReplicationCoefficients.from_cost(cost)
    out = np.zeros(g)
    _comm_per_gpu(traffic, gpn, coef.nvlink_per_token, coef.nic_per_token, out)
    expected = cost.comm_time(traffic) - 4 * HOPPER.alltoall_latency_s
    np.testing.assert_allclose(out * coef.seconds_per_token, expected, rtol=1e-9)


def test_linear_objective_is_the_cost_model_when_compute_bound() -> None:
    """With every copy well above the roofline's memory-bound count, the linearisation is exact."""
    rng = np.random.default_rng(3)
    cost = _cost(2, 4)
    load = rng.integers(200, 400, size=(2, 8, 64)).astype(np.int32)
    home = np.broadcast_to(static_placement(1, 64, 8)[0], (2, 64))
    assign = home_assign(load, home, 8)
    half = assign[:, 0, 0] // 2  # expert 0 (home GPU 0): half of it on GPU 3 of the same node
    assign[:, 0, 0] -= half
    assign[:, 0, 3] += half
    np.testing.assert_allclose(
        linear_objective(load, assign, home, cost), cost.moe(load, assign).t_moe, rtol=1e-9
    )


def test_bad_inputs_are_refused() -> None:
    cost = _cost(1, 4)
    load = np.ones((4, 8), dtype=np.int32)
    with pytest.raises(ValueError, match="home"):
        replicate_greedy(load, np.zeros(7, dtype=np.int32), cost, 1)
    with pytest.raises(ValueError, match="G=4"):
        replicate_greedy(np.ones((3, 8)), np.zeros(8, dtype=np.int32), cost, 1)
    with pytest.raises(ValueError, match="split"):
        replicate_greedy(load, static_placement(1, 8, 4)[0], cost, 1, split="simplex")  # type: ignore[arg-type]


def test_greedy_on_real_olmoe_prefill(shared_traces) -> None:
    """Per-request counts of the real OLMoE trace, spread over 8 GPUs: replication flattens every layer."""
    counts = np.load(shared_traces / "olmoe-prefill-counts" / "math.npz")["routing_counts"].astype(np.int64)
    olmoe = ModelSpec("olmoe-1b-7b", 16, 16, 2048, 1024, 64, 8, 16, 16, 128)
    cost = _cost(1, 8, olmoe)
    gpu = np.arange(counts.shape[0]) % 8
    load = np.zeros((16, 8, 64), dtype=np.int64)
    for s, g in enumerate(gpu):  # [L, G, E]
        load[:, g] += counts[s]
    load = load.astype(np.int32)
    home = static_placement(16, 64, 8)
    rep = replicate_greedy(load, home, cost, 2)
    check_assignment(
        home, rep.assign[None], load[None], gpus_per_node=8, replica_slots=2, replicas=rep.replicas[None]
    )
    skew = _compute(rep.assign).max(-1) / _compute(rep.assign).mean(-1)
    skew0 = _compute(home_assign(load, home, 8)).max(-1) / _compute(home_assign(load, home, 8)).mean(-1)
    assert skew.mean() < skew0.mean() and skew.max() < 1.1


# ------------------------------------------------------------------------------------------ buffer
@pytest.mark.parametrize(
    ("name", "hidden", "ffn", "layers"),
    [("qwen3-30b-a3b", 2048, 768, 48), ("qwen3-235b-a22b", 4096, 1536, 94)],
)
def test_layer_shared_buffer_matches_paper(name: str, hidden: int, ffn: int, layers: int) -> None:
    model = ModelSpec(name, layers, layers, hidden, ffn, 128, 8, 32, 4, 128)
    fp = buffer_footprint(model, 2, ep=16)
    assert fp.layer_shared_bytes == replica_buffer_bytes(model, 2) == 2 * 3 * hidden * ffn * 2
    assert fp.layer_shared_bytes / 2**20 == pytest.approx(PAPER_BUFFER_MIB[name])
    assert fp.per_layer_bytes == layers * fp.layer_shared_bytes
    assert fp.per_layer_fraction == pytest.approx(layers * fp.layer_shared_fraction)


def test_parameter_share_scales_with_layout() -> None:
    full = per_gpu_parameter_bytes(MODEL, ep=1)
    assert per_gpu_parameter_bytes(MODEL, ep=8) < full
    assert per_gpu_parameter_bytes(MODEL, ep=8, pp=2) == pytest.approx(
        per_gpu_parameter_bytes(MODEL, ep=8) / 2
    )
    with pytest.raises(ValueError, match="ep=0"):
        per_gpu_parameter_bytes(MODEL, ep=0)
    with pytest.raises(ValueError, match="replica_slots"):
        replica_buffer_bytes(MODEL, -1)


def test_best_acceptance_is_no_worse_than_either_rule() -> None:
    """``best`` keeps the lowest T_MoE of its runs, which include the ``comm`` and ``compute`` results."""
    rng = np.random.default_rng(7)
    cost = _cost(2, 4)
    load = _skewed_loads(rng, 6, 8, 64, tokens=1024)
    load[:, 0] *= 6  # one heavy sender (one long response): communication-bound
    home = np.broadcast_to(static_placement(1, 64, 8)[0], (6, 64))
    obj = {
        mode: linear_objective(
            load, replicate_greedy(load, home, cost, 2, acceptance=mode).assign, home, cost
        )
        for mode in ("best", "comm", "compute")
    }
    # NOTE: the rounding to whole tokens moves the objective by far less than 1e-4.
    assert np.all(obj["best"] <= np.minimum(obj["comm"], obj["compute"]) * (1 + 1e-4))
    with pytest.raises(ValueError, match="acceptance"):
        replicate_greedy(load, home, cost, 2, acceptance="greedy")  # type: ignore[arg-type]
