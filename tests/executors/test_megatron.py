"""Megatron-core integration: routing replay, ReLibra placement and replication inside ``MoELayer``.

The distributed checks run once, in one spawned gloo group of 4 ranks (EP 4): every rank builds the plain
Megatron model and the ReLibra one (same weights per logical expert) and trains four batches of two
micro-batches each with replayed routes and Adam, each batch after moving experts to its plan's placement.
Batches 0 and 1 carry hand-made plans (random placement, random replicas and splits); batches 2 and 3 carry
plans of the real planners (``relibra`` and ``relibra_replicate_only``), made in this process from skewed
per-sample routes through the control plane of :mod:`relibra.megatron.planning` (routes -> trace -> counts
-> workload -> batch context -> plan), each rank training the samples the plan gives it. The same run
records routes, writes them as a trace file and replays them. A smoke test runs the RL-step example.

Every test runs on each release the adapter supports (:mod:`relibra.megatron.compat`): 0.16.1 in the
default environment, 0.19.2 in its own (``make test-megatron``); the tests of one release's API skip on the
other with a message that names where they run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install '.[megatron]'")

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.executors.plan_check import routes_load
from relibra.executors.torch_executor import launch
from relibra.integrations.expert_names import ExpertNaming, to_logical
from relibra.invariants import check_plan
from relibra.megatron.compat import (
    SUPPORTED,
    UnsupportedMegatronVersion,
    api_for,
    installed_version,
    megatron_api,
)
from relibra.megatron.cpu_patches import applied_patches, cpu_patches, patches_for
from relibra.megatron.physical import PhysicalExpertMap, log2phy, next_phy2log, slot_table
from relibra.megatron.planning import load_hardware, microbatch_samples, plan_routes, planning_specs
from relibra.megatron.router import ReplicatingRouter
from relibra.planners.compose import ComposedPlanner, relibra, relibra_replicate_only
from relibra.planners.protocols import BatchContext, static_placement
from relibra.planners.replicate.greedy import GreedyConfig
from relibra.types import BatchPlan
from tests.builders import hand_hardware

pytestmark = pytest.mark.megatron

WORLD = 4
R = 2
NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K = 2, 16, 8, 8, 2
NUM_MB = 2
ATOL = 2e-5
RTOL = 1e-5
"""Float32 summation order differs between the plain and the physical model (grads of hot experts sum
hundreds of tokens)."""
REPO = Path(__file__).resolve().parents[2]
PLANNED: dict[str, Callable[..., ComposedPlanner]] = {
    "relibra": relibra,
    "relibra_replicate_only": relibra_replicate_only,
}
"""The planners of the planned batches (2, 3), in batch order."""
BATCHES = ("handmade-0", "handmade-1", *PLANNED)
SAMPLES = 16
"""Samples per planned batch: 4 per rank, 2 per micro-batch."""


# ------------------------------------------------------------------------------------ case builders
def _cluster() -> ClusterSpec:
    return ClusterSpec(1, WORLD, hand_hardware("cpu", 1e12, 1e11, 1e10, 1e9))


def _model_spec() -> ModelSpec:
    return ModelSpec("tiny", NUM_LAYERS, NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, 1, 1, HIDDEN)


def skewed_routes(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Distinct top-k experts per token, experts 0 and 1 hot: int64 [T, L, k]."""
    weight = np.ones(NUM_EXPERTS)
    weight[:2] = 6.0
    keys = rng.random((tokens, NUM_LAYERS, NUM_EXPERTS)) ** (
        1.0 / weight
    )  # weighted sampling w/o replacement
    return np.argsort(-keys, axis=-1)[..., :TOP_K].astype(np.int64)


def batch_routes(rng: np.random.Generator) -> list[list[np.ndarray]]:
    """routes[m][rank]: int64 [T, L, k], 4 to 9 tokens each."""
    return [[skewed_routes(rng, int(rng.integers(4, 10))) for _ in range(WORLD)] for _ in range(NUM_MB)]


def context(routes: list[list[np.ndarray]]) -> BatchContext:
    """One sample per (micro-batch, rank)."""
    counts = np.stack([routes_load(routes[m][j], NUM_EXPERTS) for m in range(NUM_MB) for j in range(WORLD)])
    sample_gpu = np.tile(np.arange(WORLD), NUM_MB).astype(np.int32)
    sample_mb = np.repeat(np.arange(NUM_MB), WORLD).astype(np.int32)
    load = np.zeros((NUM_MB, NUM_LAYERS, WORLD, NUM_EXPERTS), dtype=np.int32)
    for s in range(len(counts)):
        load[sample_mb[s], :, sample_gpu[s]] += counts[s]
    tokens = np.array([len(routes[m][j]) for m in range(NUM_MB) for j in range(WORLD)], dtype=np.int64)
    cluster, model = _cluster(), _model_spec()
    return BatchContext(
        batch=0,
        counts=counts.astype(np.int32),
        sample_tokens=tokens,
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        load=load,
        cluster=cluster,
        model=model,
        cost=CostModel(cluster, model),
    )


def handmade_plan(rng: np.random.Generator, ctx: BatchContext) -> BatchPlan:
    """A random balanced placement; per (micro-batch, layer) every rank replicates up to R hot non-home
    experts, and each expert's tokens are split at random over its copies."""
    per_gpu = NUM_EXPERTS // WORLD
    home = np.stack([rng.permutation(NUM_EXPERTS) // per_gpu for _ in range(NUM_LAYERS)]).astype(np.int32)
    replicas = np.full((NUM_MB, NUM_LAYERS, WORLD, R), -1, dtype=np.int32)
    assign = np.zeros((NUM_MB, NUM_LAYERS, NUM_EXPERTS, WORLD), dtype=np.int32)
    for m in range(NUM_MB):
        for layer in range(NUM_LAYERS):
            total = ctx.load[m, layer].sum(axis=0)  # [E]
            hot = np.argsort(-total, kind="stable")[:3]
            for g in range(WORLD):
                cand = [e for e in hot if home[layer, e] != g][: int(rng.integers(0, R + 1))]
                replicas[m, layer, g, : len(cand)] = cand
            for e in range(NUM_EXPERTS):
                copies = np.flatnonzero((replicas[m, layer] == e).any(axis=1))
                copies = np.union1d(copies, [home[layer, e]])
                cuts = np.sort(rng.integers(0, total[e] + 1, len(copies) - 1))
                assign[m, layer, e, copies] = np.diff(np.concatenate([[0], cuts, [total[e]]]))
    return BatchPlan(
        home=home, assign=assign, load=ctx.load.copy(), sample_gpu=ctx.sample_gpu.copy(), replicas=replicas
    )


def planned_batch(
    planner: str, batch: int
) -> tuple[BatchContext, BatchPlan, list[list[np.ndarray]], list[list[torch.Tensor]]]:
    """Skewed routes of ``SAMPLES`` samples, planned by ``planner`` (``replica_slots=R``); returns the
    context, the plan, and the routes [m][rank] and inputs [m][rank] of the samples each rank trains.

    Samples hold 24 to 63 tokens: with fewer, the cost model (OLMoE-sized experts on Hopper) finds that
    copying an expert costs more than the compute it saves, and the planners replicate nothing. At these
    sizes a copy's buffer refill (35 us) is not hidden by the micro-batch's attention either, so the
    planners run with ``GreedyConfig(refill_aware=False)``: these tests check the adapter's replica path,
    which needs copies (tests/planners/test_refill.py checks that copies pay for their refill).
    """
    rng = np.random.default_rng(batch)
    sample_routes = [skewed_routes(rng, int(rng.integers(24, 64))) for _ in range(SAMPLES)]
    sample_inputs = [
        torch.randn(len(r), HIDDEN, generator=torch.Generator().manual_seed(1_000 * batch + s))
        for s, r in enumerate(sample_routes)
    ]
    cluster, model = planning_specs(
        load_hardware(REPO / "experiments/conf/cluster/hopper.yaml"), WORLD, NUM_LAYERS, NUM_EXPERTS, TOP_K
    )
    plan, ctx = plan_routes(
        sample_routes,
        PLANNED[planner](replica_slots=R, replicate=GreedyConfig(refill_aware=False)),
        cluster,
        model,
        2,
    )
    assert ctx.num_microbatches == NUM_MB
    routes, inputs = [], []
    for m in range(NUM_MB):
        mine = [microbatch_samples(plan.sample_gpu, ctx.sample_mb, rank, m) for rank in range(WORLD)]
        routes.append([np.concatenate([sample_routes[s] for s in ids]) for ids in mine])
        inputs.append([torch.cat([sample_inputs[s] for s in ids]) for ids in mine])
    return ctx, plan, routes, inputs


# ----------------------------------------------------------------------------------------- per rank
def _train_batch(model, optimizer, batch, inputs, plan, rank):  # type: ignore[no-untyped-def]
    """Forward and backward every micro-batch with replayed routes; returns outputs, input grads, grads."""
    from relibra.megatron.replay import replaying

    outs, xgrads = [], []
    for m, routes in enumerate(batch):
        if plan is not None:
            model.adapter.set_microbatch(plan, m)
        x = inputs[m][rank].clone().requires_grad_(True)
        with replaying(routes[rank], model.routers, NUM_EXPERTS):
            y = model(x)
        (y * torch.linspace(-1.0, 1.0, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach().numpy().copy())
        xgrads.append(x.grad.numpy().copy())
    grads = {
        "experts": [model.expert_grad_state(layer) for layer in range(NUM_LAYERS)],
        "routers": [r.weight.grad.numpy().copy() for r in model.routers],
        "mix": model.mix.grad.numpy().copy(),
    }
    return outs, xgrads, grads


def run_rank(rank: int, world: int, batches, inputs, plans, trace_path: str) -> dict:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    from relibra.megatron.model import TinyMoEModel, TinyMoESpec, init_expert_parallel
    from relibra.megatron.replay import recorded_routes, recording, replaying, routes_to_trace, trace_routes
    from relibra.trace.format import load_trace, save_trace

    init_expert_parallel(world)
    spec = TinyMoESpec(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K, seed=3)
    plain = TinyMoEModel(spec, world)
    relib = TinyMoEModel(spec, world, replica_slots=R)
    out: dict = {"plain": [], "relibra": [], "moved": [], "moved_grads": [], "weights": []}
    opts = [torch.optim.Adam(m.trainable_parameters(), lr=1e-2) for m in (plain, relib)]
    assert relib.adapter is not None
    for b, (batch, plan) in enumerate(zip(batches, plans, strict=True)):
        out["moved"].append(relib.adapter.apply_placement(plan.home, opts[1]))
        # The grads of the last batch travel with their experts.
        out["moved_grads"].append(
            [relib.expert_grad_state(layer) for layer in range(NUM_LAYERS)] if b > 0 else None
        )
        for opt in opts:
            opt.zero_grad()
        out["plain"].append(_train_batch(plain, opts[0], batch, inputs[b], None, rank))
        out["relibra"].append(_train_batch(relib, opts[1], batch, inputs[b], plan, rank))
        for opt in opts:
            opt.step()
        out["weights"].append(
            {
                name: [m.expert_state(layer) for layer in range(NUM_LAYERS)]
                for name, m in (("plain", plain), ("relibra", relib))
            }
        )
    out["buffer_fills"] = relib.adapter.buffer.fills
    # The physical model's experts as a weight converter names them (mbridge, Megatron-Bridge: global id
    # = rank * local rows + row, local rows = E / G + r here), gathered over the EP group as their export is.
    slots = relib.expert_map.slots_per_gpu
    named = [
        (f"decoder.layers.{layer}.mlp.experts.{rank * slots + i}.{part}.weight",
         getattr(mlp, part).weight.detach().numpy().copy())
        for layer in range(NUM_LAYERS)
        for i, mlp in enumerate(relib.moe[layer].experts.local_experts)
        for part in ("linear_fc1", "linear_fc2")
    ]  # fmt: skip
    exported: list = [None] * world
    dist.all_gather_object(exported, named)
    out["exported"] = [pair for rank_pairs in exported for pair in rank_pairs]
    out["phy2log"] = relib.adapter.phy2log.copy()
    # RECORD -> trace file -> REPLAY_FORWARD, on the plain model (the rollout side).
    x = inputs[0][0][rank]
    with torch.no_grad(), recording(plain.routers):
        y_record = plain(x)
    rec = recorded_routes(plain.routers)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rec)
    if rank == 0:
        save_trace(routes_to_trace(gathered, NUM_EXPERTS, model="tiny"), trace_path)
    dist.barrier()
    replayed = trace_routes(load_trace(trace_path), [rank])
    with torch.no_grad(), replaying(replayed, plain.routers, NUM_EXPERTS):
        y_replay = plain(x)
    with torch.no_grad(), replaying(np.roll(replayed, 1, axis=-1), plain.routers, NUM_EXPERTS):
        y_shuffled = plain(x)  # same expert sets, other top-k order: same output
    with torch.no_grad(), replaying((replayed + 1) % NUM_EXPERTS, plain.routers, NUM_EXPERTS):
        y_other = plain(x)
    out["record"] = dict(
        routes=rec,
        replayed=replayed,
        y_record=y_record.numpy(),
        y_replay=y_replay.numpy(),
        y_shuffled=y_shuffled.numpy(),
        y_other=y_other.numpy(),
    )
    return out


@functools.cache
def world_run() -> tuple[list, list, list[dict]]:
    """Plans every batch in this process (the planners' numba kernels compile once, cached on disk), then
    trains them all in one spawned group."""
    rng = np.random.default_rng(7)
    batches = [batch_routes(rng) for _ in range(2)]
    inputs = [
        [
            [
                torch.randn(
                    len(batches[b][m][j]),
                    HIDDEN,
                    generator=torch.Generator().manual_seed(100 * b + 10 * m + j),
                )
                for j in range(WORLD)
            ]
            for m in range(NUM_MB)
        ]
        for b in range(2)
    ]
    ctxs = [context(bt) for bt in batches]
    plans = [handmade_plan(rng, ctx) for ctx in ctxs]
    for planner in PLANNED:
        ctx, plan, routes, xs = planned_batch(planner, len(batches))
        ctxs.append(ctx)
        plans.append(plan)
        batches.append(routes)
        inputs.append(xs)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = launch(run_rank, WORLD, batches, inputs, plans, str(Path(tmp) / "recorded.npz"))
    return ctxs, plans, ranks


@pytest.fixture(scope="module")
def run() -> tuple[list, list, list[dict]]:
    return world_run()


def _merged(per_rank: list[dict[int, np.ndarray]]) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for d in per_rank:
        assert not set(d) & set(out), "two ranks hold the same logical expert at home"
        out.update(d)
    assert sorted(out) == list(range(NUM_EXPERTS))
    return out


# ------------------------------------------------------------------------------- distributed checks
def test_plans_are_valid_and_exercise_the_adapter(run) -> None:  # type: ignore[no-untyped-def]
    ctxs, plans, ranks = run
    for ctx, plan in zip(ctxs, plans, strict=True):
        check_plan(plan, ctx, replica_slots=R)
    static = np.arange(NUM_EXPERTS) // (NUM_EXPERTS // WORLD)
    assert (plans[0].home != static).any(), "the first plan must move experts away from the static placement"
    assert all((plan.replicas >= 0).sum() > 0 for plan in plans), "every plan must replicate"
    assert sum(r["buffer_fills"] for r in ranks) > 0


def test_planner_plans_replicate_hot_experts_and_reorder(run) -> None:  # type: ignore[no-untyped-def]
    """The planned batches exercise what the hand-made ones do: ``relibra`` re-homes experts (hot experts 0
    and 1 share rank 0 under the static placement) and both planners fill replica slots, hot experts among
    the replicas; every rank trains samples of every micro-batch."""
    ctxs, plans, _ = run
    static = static_placement(NUM_LAYERS, NUM_EXPERTS, WORLD)
    by_name = dict(zip(BATCHES, zip(ctxs, plans, strict=True), strict=True))
    ctx, plan = by_name["relibra"]
    assert (plan.home != static).any(), "relibra must move experts away from the static placement"
    assert (plan.home[:, 0] != plan.home[:, 1]).all(), "relibra must separate the two hot experts"
    ctx, plan = by_name["relibra_replicate_only"]
    np.testing.assert_array_equal(plan.home, static)
    for name in PLANNED:
        ctx, plan = by_name[name]
        replicated = plan.replicas[plan.replicas >= 0]
        assert replicated.size > 0, f"{name} filled no replica slot"
        assert np.isin(replicated, [0, 1]).any(), f"{name} replicated no hot expert: {np.unique(replicated)}"
        at_home = np.take_along_axis(plan.assign, plan.home[None, :, :, None].astype(np.int64), axis=-1)
        assert plan.assign.sum() > at_home.sum(), f"{name} sends no token to a replica"
        per_rank_mb = np.zeros((WORLD, NUM_MB), dtype=np.int64)
        np.add.at(per_rank_mb, (plan.sample_gpu, ctx.sample_mb), 1)
        assert (per_rank_mb > 0).all(), f"{name}: a rank trains no sample in some micro-batch"


@pytest.mark.parametrize("batch", range(len(BATCHES)), ids=BATCHES)
def test_outputs_and_input_grads_match_plain_layer(run, batch: int) -> None:  # type: ignore[no-untyped-def]
    _, _, ranks = run
    for rank, r in enumerate(ranks):
        (p_out, p_xg, _), (q_out, q_xg, _) = r["plain"][batch], r["relibra"][batch]
        assert len(q_out) == len(p_out) == NUM_MB
        for m in range(NUM_MB):
            assert p_out[m].shape[0] > 0
            np.testing.assert_allclose(
                q_out[m], p_out[m], atol=ATOL, rtol=RTOL, err_msg=f"rank {rank} mb {m} output"
            )
            np.testing.assert_allclose(
                q_xg[m], p_xg[m], atol=ATOL, rtol=RTOL, err_msg=f"rank {rank} mb {m} input grad"
            )


@pytest.mark.parametrize("batch", range(len(BATCHES)), ids=BATCHES)
def test_weight_grads_match_plain_layer(run, batch: int) -> None:  # type: ignore[no-untyped-def]
    _, _, ranks = run
    for layer in range(NUM_LAYERS):
        plain = _merged([r["plain"][batch][2]["experts"][layer] for r in ranks])
        relib = _merged([r["relibra"][batch][2]["experts"][layer] for r in ranks])
        assert sum(np.abs(g).sum() > 0 for g in plain.values()) >= NUM_EXPERTS // 2
        for e in range(NUM_EXPERTS):
            # NOTE: a gradient sums hundreds of tokens' fp32 products in another order in each model, so
            # its rounding scales with its largest entry; a lost or doubled token would differ by far more.
            scale = max(1.0, float(np.abs(plain[e]).max()))
            np.testing.assert_allclose(
                relib[e], plain[e], atol=ATOL * scale, rtol=RTOL, err_msg=f"layer {layer} expert {e} grad"
            )
    for rank, r in enumerate(ranks):
        for name in ("routers", "mix"):
            np.testing.assert_allclose(
                np.asarray(r["relibra"][batch][2][name]),
                np.asarray(r["plain"][batch][2][name]),
                atol=ATOL,
                rtol=RTOL,
                err_msg=f"rank {rank} {name} grad",
            )


@pytest.mark.parametrize("batch", range(len(BATCHES)), ids=BATCHES)
def test_weights_after_adam_step_match_plain_layer(run, batch: int) -> None:  # type: ignore[no-untyped-def]
    """After the batch's Adam step (Adam state moved with its experts), every expert's weights equal the
    plain model's, and every rank holds exactly the experts the plan homes on it."""
    _, plans, ranks = run
    for layer in range(NUM_LAYERS):
        plain = _merged([r["weights"][batch]["plain"][layer] for r in ranks])
        relib = _merged([r["weights"][batch]["relibra"][layer] for r in ranks])
        for e in range(NUM_EXPERTS):
            np.testing.assert_allclose(
                relib[e], plain[e], atol=ATOL, rtol=RTOL, err_msg=f"layer {layer} expert {e} weights"
            )
        for rank, r in enumerate(ranks):
            held = set(r["weights"][batch]["relibra"][layer])
            assert held == set(np.flatnonzero(plans[batch].home[layer] == rank)), f"rank {rank} layer {layer}"
    if batch > 0:  # Adam moved the weights: the step is not a no-op
        before = _merged([r["weights"][batch - 1]["plain"][0] for r in ranks])
        after = _merged([r["weights"][batch]["plain"][0] for r in ranks])
        assert any(not np.array_equal(before[e], after[e]) for e in range(NUM_EXPERTS))


@pytest.mark.parametrize("batch", range(1, len(BATCHES)), ids=BATCHES[1:])
def test_placement_moves_grads(run, batch: int) -> None:  # type: ignore[no-untyped-def]
    """Moving to batch ``batch``'s placement carries the last batch's gradients with the experts."""
    _, plans, ranks = run
    assert ranks[0]["moved"][batch] == int((plans[batch - 1].home != plans[batch].home).sum()) > 0
    for layer in range(NUM_LAYERS):
        moved = _merged([r["moved_grads"][batch][layer] for r in ranks])
        before = _merged([r["plain"][batch - 1][2]["experts"][layer] for r in ranks])
        for e in range(NUM_EXPERTS):
            np.testing.assert_allclose(
                moved[e], before[e], atol=ATOL, rtol=RTOL, err_msg=f"layer {layer} expert {e}"
            )


MCORE_EXPERTS = ExpertNaming(r"decoder\.layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\..+")


def test_export_of_the_physical_model_is_the_logical_model(run) -> None:  # type: ignore[no-untyped-def]
    """After placement moves and training, the physical model's gathered export, renamed through the
    adapter's phy2log (:func:`relibra.integrations.expert_names.to_logical`), holds each logical expert
    once, with the weights the adapter holds for it (which match the plain model's:
    test_weights_after_adam_step_match_plain_layer); named through the static placement it would not."""
    _, _, ranks = run
    expert_map = PhysicalExpertMap(NUM_EXPERTS, WORLD, R)
    phy2log = ranks[0]["phy2log"]
    assert all(np.array_equal(r["phy2log"], phy2log) for r in ranks)
    assert not np.array_equal(phy2log, expert_map.static_phy2log(NUM_LAYERS))  # the plans moved experts
    trained = [_merged([r["weights"][-1]["relibra"][layer] for r in ranks]) for layer in range(NUM_LAYERS)]
    pairs = ranks[0]["exported"]
    assert len(pairs) == NUM_LAYERS * expert_map.num_physical * 2  # replica slots exported too
    logical = dict(to_logical(pairs, expert_map, phy2log, MCORE_EXPERTS))
    assert len(logical) == NUM_LAYERS * NUM_EXPERTS * 2
    for layer in range(NUM_LAYERS):
        for e in range(NUM_EXPERTS):
            name = f"decoder.layers.{layer}.mlp.experts.{e}"
            flat = np.concatenate(
                [logical[f"{name}.{p}.weight"].ravel() for p in ("linear_fc1", "linear_fc2")]
            )
            np.testing.assert_array_equal(flat, trained[layer][e].ravel(), err_msg=name)
    static = dict(to_logical(pairs, expert_map, expert_map.static_phy2log(NUM_LAYERS), MCORE_EXPERTS))
    assert any(not np.array_equal(static[k], logical[k]) for k in logical), (
        "the static placement would name the moved experts' weights wrongly"
    )


def test_record_trace_replay_round_trip(run) -> None:  # type: ignore[no-untyped-def]
    _, _, ranks = run
    for rank, r in enumerate(ranks):
        rec = r["record"]
        assert rec["routes"].shape == (len(rec["y_record"]), NUM_LAYERS, TOP_K)
        np.testing.assert_array_equal(rec["replayed"], rec["routes"])
        np.testing.assert_array_equal(rec["y_replay"], rec["y_record"])
        np.testing.assert_allclose(rec["y_shuffled"], rec["y_record"], atol=1e-6)
        assert not np.allclose(rec["y_other"], rec["y_record"]), (
            f"rank {rank}: other routes must change the output"
        )


# --------------------------------------------------------------------------------- local unit checks
def test_log2phy_and_next_phy2log() -> None:
    expert_map = PhysicalExpertMap(num_experts=8, num_gpus=4, replica_slots=1)
    assert expert_map.num_physical == 12 and expert_map.slots_per_gpu == 3
    p2l = expert_map.static_phy2log(1)
    np.testing.assert_array_equal(log2phy(expert_map, p2l)[0], [0, 1, 3, 4, 6, 7, 9, 10])
    new_home = np.array([[1, 0, 0, 2, 2, 3, 3, 1]])
    nxt = next_phy2log(p2l, new_home)
    # Kept experts keep their rows (1 on rank 0, 4 on rank 2, 6 on rank 3); incoming ones fill the freed rows,
    # ascending (rank 1 lost both of [2, 3] and takes 0, 7).
    np.testing.assert_array_equal(nxt[0], [[2, 1], [0, 7], [4, 3], [6, 5]])
    with pytest.raises(ValueError, match="expected E / G = 2"):
        next_phy2log(p2l, np.array([[0, 0, 0, 2, 2, 3, 3, 1]]))


def test_slot_table_refuses_copies_the_plan_does_not_hold() -> None:
    expert_map = PhysicalExpertMap(num_experts=4, num_gpus=2, replica_slots=1)
    home = np.array([0, 0, 1, 1])
    home_phys = log2phy(expert_map, expert_map.static_phy2log(1))[0]  # [0, 1, 3, 4]
    replicas = np.array([[-1], [0]])  # rank 1's slot holds expert 0
    split = np.array([[2, 3], [1, 0], [0, 4], [0, 1]])
    phys, bound = slot_table(expert_map, home_phys, home, replicas, split)
    assert phys[0, 1] == 5 and phys[0, 0] == 0
    np.testing.assert_array_equal(bound[:, -1], split.sum(axis=1))
    bad = split.copy()
    bad[1, 1] = 2
    with pytest.raises(ValueError, match="expert 1 to rank 1"):
        slot_table(expert_map, home_phys, home, replicas, bad)


class _FixedRouter(torch.nn.Module):
    """Stands in for a logical TopKRouter: fixed probs and mask."""

    def __init__(self, routes: np.ndarray, num_experts: int) -> None:
        super().__init__()
        t = len(routes)
        self.mask = torch.zeros(t, num_experts, dtype=torch.bool)
        self.mask[torch.arange(t)[:, None], torch.as_tensor(routes)] = True
        self.probs: torch.Tensor = torch.rand(t, num_experts) * self.mask

    def forward(self, hidden, padding_mask=None):  # type: ignore[no-untyped-def]
        return self.probs, self.mask


def test_replicating_router_splits_tokens_in_token_order() -> None:
    expert_map = PhysicalExpertMap(num_experts=4, num_gpus=2, replica_slots=1)
    routes = np.array([[0, 1], [0, 2], [3, 0], [0, 1], [2, 0]])  # expert 0 on tokens 0..4
    router = ReplicatingRouter(_FixedRouter(routes, 4), expert_map)
    home_phys = log2phy(expert_map, expert_map.static_phy2log(1))[0]
    split = np.array(
        [[3, 2], [2, 0], [0, 2], [0, 1]]
    )  # expert 0: first 3 tokens home, last 2 on rank 1's slot
    replicas = np.array([[-1], [0]])
    router.set_table(slot_table(expert_map, home_phys, np.array([0, 0, 1, 1]), replicas, split))
    probs, mask = router(torch.zeros(5, 1, 8))
    assert mask.shape == (5, 6) and (mask.sum(dim=1) == 2).all()
    np.testing.assert_array_equal(mask[:, 0].numpy(), [1, 1, 1, 0, 0])
    np.testing.assert_array_equal(mask[:, 5].numpy(), [0, 0, 0, 1, 1])
    assert torch.equal(probs.sum(dim=1), router.logical.probs.sum(dim=1))
    more = split.copy()
    more[0, 0] += 1  # the plan counted one more token of expert 0 than these routes hold
    router.set_table(slot_table(expert_map, home_phys, np.array([0, 0, 1, 1]), replicas, more))
    with pytest.raises(ValueError, match="replay the routes the plan was made from"):
        router(torch.zeros(5, 1, 8))


def test_cpu_patches_apply_and_restore() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU patches are not applied where CUDA is available")
    from megatron.core.transformer.moe import moe_utils

    missing = object()
    before = set(applied_patches())
    gemm = getattr(moe_utils, "te_general_gemm", missing)
    with cpu_patches() as names:
        assert set(names) == {p.name for p in patches_for(megatron_api())}
        assert moe_utils.te_general_gemm is None
        assert torch.cuda.current_device() == torch.device("cpu")
    if not before:
        assert applied_patches() == ()
        assert getattr(moe_utils, "te_general_gemm", missing) is gemm
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()
    assert all(p.reason for p in patches_for(megatron_api()))


# ------------------------------------------------------------------------------------ release checks
NEEDS_0_19 = pytest.mark.skipif(
    installed_version() != "0.19.2",
    reason=f"needs megatron-core 0.19.2 (Python 3.12), {installed_version()} is installed: run "
    "`make test-megatron`",
)


def test_installed_release_is_supported_and_its_api_matches_the_table() -> None:
    """The compat table's entry for the installed release says what its source does: the router builder's
    keywords, and whether ``moe_utils.te_general_gemm`` exists without Transformer Engine."""
    import inspect

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter

    api = megatron_api()
    assert api.version == installed_version() and api is SUPPORTED[api.version]
    takes = "is_mtp_layer" in inspect.signature(TopKRouter.__init__).parameters
    assert takes == api.router_builder_takes_is_mtp_layer
    if "te_general_gemm" not in applied_patches() and importlib.util.find_spec("transformer_engine") is None:
        assert hasattr(moe_utils, "te_general_gemm") != api.te_general_gemm_missing_without_te


@pytest.mark.parametrize("version", ["0.15.0", "0.16.0", "0.17.0", "0.18.1", "0.19.1", "0.20.0", "0.19.2rc0"])
def test_unproven_release_is_refused_with_one_message(version: str) -> None:
    refused = re.escape(f"megatron-core {version} is installed")
    with pytest.raises(UnsupportedMegatronVersion, match=refused) as err:
        api_for(version)
    assert "0.16.1" in str(err.value) and "0.19.2" in str(err.value) and "docs/megatron.md" in str(err.value)


def test_unproven_release_is_refused_before_a_layer_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from relibra.megatron import compat
    from relibra.megatron.router import replicating_router

    monkeypatch.setattr(compat, "installed_version", lambda: "0.18.0")
    compat.megatron_api.cache_clear()
    refused = re.escape("megatron-core 0.18.0 is installed")
    try:
        with pytest.raises(UnsupportedMegatronVersion, match=refused):
            replicating_router(PhysicalExpertMap(NUM_EXPERTS, WORLD, R))
        with pytest.raises(UnsupportedMegatronVersion, match=refused), cpu_patches(force=True):
            pass
    finally:
        monkeypatch.undo()
        compat.megatron_api.cache_clear()
    assert megatron_api().version == installed_version()


def _layer_config(**overrides):  # type: ignore[no-untyped-def]
    from relibra.megatron.model import TinyMoESpec, moe_config

    config = moe_config(TinyMoESpec(NUM_LAYERS, HIDDEN, FFN, NUM_EXPERTS, TOP_K), NUM_EXPERTS, 1)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def test_replay_config_refuses_what_bypasses_replay() -> None:
    from relibra.megatron.replay import check_replay_config

    check_replay_config(_layer_config())
    with pytest.raises(ValueError, match="moe_router_load_balancing_type='sinkhorn' bypasses RouterReplay"):
        check_replay_config(_layer_config(moe_router_load_balancing_type="sinkhorn"))
    with pytest.raises(ValueError, match="moe_router_fusion=True"):
        check_replay_config(_layer_config(moe_router_fusion=True))


@NEEDS_0_19
def test_quantile_balancing_is_refused_on_0_19() -> None:
    """0.19.2's quantile balancing picks its own top-k (``TopKRouter.quantile_balancing``) and would ignore
    the replayed routes."""
    from relibra.megatron.replay import check_replay_config

    # a real config: 0.19.2's TransformerConfig validates the type (0.16.1 has no quantile balancing)
    config = dataclasses.replace(_layer_config(), moe_router_load_balancing_type="quantile_balancing")
    bypass = re.escape("'quantile_balancing' bypasses RouterReplay in megatron-core 0.19.2")
    with pytest.raises(ValueError, match=bypass):
        check_replay_config(config)


# ------------------------------------------------------------------------------------------ example
@pytest.mark.slow  # 51 s (four megatron-core imports); the adapter checks above cover the same path
def test_rl_step_example_matches_plain_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    """``examples/megatron_rl_step.py`` end to end (4 ranks, default sizes): it records, plans with
    ``relibra``, re-homes experts, fills replica slots and trains the same step as plain Megatron."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # spawned ranks inherit sys.path
    example = importlib.import_module("megatron_rl_step")
    summary = example.main(["--planner", "relibra", "--seed", "0"])
    assert summary["moved"] > 0 and summary["replicas"] > 0
    assert summary["plan_skew"].mean() < summary["static_skew"].mean()
    assert summary["max_loss_diff"] < 1e-6
    assert summary["max_weight_diff"] < 1e-6
