"""Replication that pays for its replica-buffer refill (relibra.planners.refill)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from baselines.megatron import MegatronPlanner
from relibra.cost.model import CostModel
from relibra.cost.pricing import attention_window
from relibra.planners.compose import relibra_replicate_only
from relibra.planners.protocols import BatchContext, Replication, static_placement
from relibra.planners.refill import replicate_within_window
from relibra.planners.replicate.greedy import GreedyConfig, GreedyReplicator
from relibra.simulator import batch_context, simulate
from tests.builders import tiny_model, tiny_setup

SLOTS = 2


@pytest.fixture(scope="module")
def setup():
    return tiny_setup(nodes=2, gpus_per_node=4, num_experts=16, samples_per_microbatch=2)


def _context(setup) -> tuple[BatchContext, np.ndarray]:
    counts, workload, cluster, model, cost = setup
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    return ctx, static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)


def _price(
    cost: CostModel, load: np.ndarray, home: np.ndarray, rep: Replication, window: float
) -> np.ndarray:
    """Per layer: T_comp + T_comm + exposed refill, as the simulator charges a (micro-batch, layer)."""
    br = cost.moe(load, rep.assign)
    return (
        br.t_compute + br.t_comm + cost.exposed_refill(cost.replica_refill_time(rep.replicas, home), window)
    )


def _large_experts(nodes: int, gpus_per_node: int, num_experts: int):
    """A tiny workload on experts of Qwen3-235B-A22B's shape: little attention, large buffer refills."""
    counts, workload, cluster, _, _ = tiny_setup(
        nodes=nodes, gpus_per_node=gpus_per_node, num_experts=num_experts, samples_per_microbatch=2
    )
    model = replace(tiny_model(num_experts=num_experts), hidden=4096, moe_ffn=1536)
    return counts, workload, cluster, model, CostModel(cluster, model)


def test_hidden_refill_keeps_the_replicators_answer(setup) -> None:
    ctx, home = _context(setup)
    replicator = GreedyReplicator(replica_slots=SLOTS)
    for m in range(ctx.num_microbatches):
        plain = replicator.replicate(ctx.load[m], home, ctx)
        out = replicate_within_window(replicator, ctx.load[m], home, ctx, window_s=1.0)
        np.testing.assert_array_equal(out.assign, plain.assign)
        np.testing.assert_array_equal(out.replicas, plain.replicas)
        assert out.stats["refill_capped_layers"] == 0.0


def test_exposed_refill_is_paid_for(setup) -> None:
    """With no attention to hide it, each layer's answer is at least as cheap as the full greedy's and as
    every expert at home, and some layers take fewer slots."""
    ctx, home = _context(setup)
    replicator = GreedyReplicator(replica_slots=SLOTS)
    home_only = replace(replicator, replica_slots=0)
    capped = 0.0
    for m in range(ctx.num_microbatches):
        load = ctx.load[m]
        out = replicate_within_window(replicator, load, home, ctx, window_s=0.0)
        assert out.replicas.shape == (load.shape[0], ctx.num_gpus, SLOTS)
        np.testing.assert_array_equal(out.assign.sum(axis=-1), load.sum(axis=-2))  # tokens conserved
        t = _price(ctx.cost, load, home, out, 0.0)
        assert np.all(t <= _price(ctx.cost, load, home, replicator.replicate(load, home, ctx), 0.0) + 1e-18)
        assert np.all(t <= _price(ctx.cost, load, home, home_only.replicate(load, home, ctx), 0.0) + 1e-18)
        capped += out.stats["refill_capped_layers"]
    assert capped > 0


def test_copies_that_cannot_pay_for_their_refill_are_dropped() -> None:
    """Large experts, few tokens and no attention window: every copy costs more than it saves."""
    counts, workload, cluster, model, cost = _large_experts(1, 4, 8)
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    replicator = GreedyReplicator(replica_slots=SLOTS)
    plain = replicator.replicate(ctx.load[0], home, ctx)
    assert (plain.replicas >= 0).any()  # the greedy alone does replicate here
    out = replicate_within_window(replicator, ctx.load[0], home, ctx, window_s=0.0)
    assert (out.replicas < 0).all()
    np.testing.assert_array_equal(
        out.assign, replace(replicator, replica_slots=0).replicate(ctx.load[0], home, ctx).assign
    )
    assert out.stats["refill_capped_layers"] == 1.0


def test_replication_alone_is_never_slower_than_megatron_where_refill_is_exposed() -> None:
    """On the static placement every (micro-batch, layer) costs at most Megatron-LM's (home-only) time,
    where the greedy alone would cost more."""
    counts, workload, cluster, model, cost = _large_experts(2, 4, 16)
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    window = attention_window(ctx, ctx.sample_gpu)
    replicator = GreedyReplicator(replica_slots=SLOTS)
    home_only = replace(replicator, replica_slots=0)
    slower = [
        _price(cost, ctx.load[m], home, replicator.replicate(ctx.load[m], home, ctx), window[m])
        > _price(cost, ctx.load[m], home, home_only.replicate(ctx.load[m], home, ctx), window[m])
        for m in range(ctx.num_microbatches)
    ]
    assert np.any(slower)  # the greedy alone loses to Megatron-LM on these layers
    ours = simulate(relibra_replicate_only(replica_slots=SLOTS), counts, workload, cluster, model, cost)
    megatron = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    layer = lambda r: r.t_compute + r.t_comm + r.t_sync_exposed  # noqa: E731
    assert np.all(layer(ours) <= layer(megatron) * (1 + 1e-12))
    assert ours.metrics["step_time_s"] <= megatron.metrics["step_time_s"] * (1 + 1e-12)


def test_window_is_the_attention_the_simulator_charges(setup) -> None:
    counts, workload, cluster, model, cost = setup
    ctx, _ = _context(setup)
    sim = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    rows = sim.mb_batch == 0
    np.testing.assert_allclose(
        attention_window(ctx, ctx.sample_gpu), sim.t_layer_attention[rows, 0], rtol=1e-12
    )


def test_a_bad_window_is_refused(setup) -> None:
    ctx, home = _context(setup)
    with pytest.raises(ValueError, match="window_s"):
        replicate_within_window(GreedyReplicator(replica_slots=SLOTS), ctx.load[0], home, ctx, window_s=-1.0)


def test_refill_aware_false_keeps_the_paper_behaviour() -> None:
    counts, workload, cluster, model, cost = _large_experts(1, 4, 8)
    ctx = batch_context(counts, workload, 0, cluster, model, cost)
    home = static_placement(counts.num_layers, counts.num_experts, cluster.num_gpus)
    replicator = GreedyReplicator(replica_slots=SLOTS, config=GreedyConfig(refill_aware=False))
    plain = replicator.replicate(ctx.load[0], home, ctx)
    out = replicate_within_window(replicator, ctx.load[0], home, ctx, window_s=0.0)
    assert (plain.replicas >= 0).any()
    np.testing.assert_array_equal(out.assign, plain.assign)
    np.testing.assert_array_equal(out.replicas, plain.replicas)
    planner = relibra_replicate_only(replica_slots=SLOTS, replicate=GreedyConfig(refill_aware=False))
    assert isinstance(planner.replicator, GreedyReplicator) and not planner.replicator.refill_aware
