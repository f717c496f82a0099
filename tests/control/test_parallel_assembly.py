"""The control plane's assembly under tensor and context parallelism (relibra/control/assembly.py): EP only
it is what it was, array for array; under TP x CP every sample becomes its ranks on one TP x CP group, as
the simulator lays them out (relibra.workload.parallel_workload), tokens are conserved and each GPU holds
what relibra.workload.rank_tokens says; the plane plans those ranks as the serial planner does."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.cluster import ClusterSpec
from relibra.control.assembly import assemble_batch, given_layout
from relibra.control.config import ControlPlaneConfig
from relibra.control.plane import ControlPlane
from relibra.cost.model import CostModel
from relibra.integrations.verl import VerlConfigError, VerlReLibraHook, VerlSettings
from relibra.invariants import check_plan
from relibra.layout import SampleLayout, layout_samples
from relibra.parallel import ParallelDims
from relibra.planners.compose import relibra, relibra_replicate_only
from relibra.planners.reorder.config import AnnealConfig
from relibra.simulator import batch_context
from relibra.types import SampleCounts
from relibra.workload import microbatch_loads, parallel_workload, rank_tokens
from tests.builders import HOPPER, random_counts, tiny_model

LAYERS, EXPERTS, SLOTS = 3, 8, 2
TP2_CP2 = ParallelDims(tp=2, cp=2)
TP4_CP4 = ParallelDims(tp=4, cp=4)
"""Wider than the EP group of 8: it holds ranks 0 .. 7 of each sample (CP ranks 0 and 1)."""


def _batch(num_samples: int = 24, seed: int = 0) -> SampleCounts:
    """One batch of skewed counts, 5 to 59 tokens a sample (fewer than ``tp * cp`` leaves some ranks empty,
    which the split handles like any other rank)."""
    return random_counts(num_samples, LAYERS, EXPERTS, num_batches=1, seed=seed)


def _setup(parallel: ParallelDims | None = None):
    cluster = ClusterSpec(nodes=1, gpus_per_node=8, hardware=HOPPER)
    model = tiny_model(num_experts=EXPERTS, num_layers=LAYERS)
    return cluster, model, CostModel(cluster, model, parallel=parallel)


@pytest.mark.parametrize("layout", ["balanced", "contiguous"])
@pytest.mark.parametrize("spm", [None, 2])
def test_ep_only_is_unchanged(layout: str, spm: int | None) -> None:
    counts = _batch()
    cluster, model, _ = _setup()
    config = ControlPlaneConfig(workers=0, samples_per_microbatch=spm, layout=layout)
    # the assembly before TP x CP, written out
    before = layout_samples(
        counts.tokens,
        np.array([0, counts.num_samples], dtype=np.int64),
        cluster.num_gpus,
        spm,
        None,
        layout,
        model.attention_span,
    )
    before_load = microbatch_loads(
        counts.counts, before.sample_gpu, before.local_mb(), before.num_microbatches, cluster.num_gpus
    )
    for parallel in (None, ParallelDims()):
        asm = assemble_batch(counts.counts, counts.tokens, cluster.num_gpus, config, model, parallel)
        for name in ("sample_gpu", "sample_mb", "mb_batch"):
            np.testing.assert_array_equal(getattr(asm.layout, name), getattr(before, name), err_msg=name)
        np.testing.assert_array_equal(asm.local_mb, before.local_mb())
        np.testing.assert_array_equal(asm.load, before_load)
        assert asm.load.dtype == before_load.dtype and asm.counts is None and asm.sample_tokens is None
        given = given_layout(before, counts.counts, cluster.num_gpus, parallel)
        np.testing.assert_array_equal(given.load, before_load)
        assert given.layout is before and given.counts is None


def _assert_ranks_on_groups(asm, counts: SampleCounts, parallel: ParallelDims, g: int) -> None:
    """Every sample's ranks on one TP x CP group in rank order, in one micro-batch; tokens conserved; each
    GPU's tokens as rank_tokens says."""
    n = parallel.group
    held = min(n, g)
    num_s = counts.num_samples
    gpu = asm.layout.sample_gpu.reshape(num_s, held)
    mb = asm.local_mb.reshape(num_s, held)
    assert asm.counts.shape == (num_s * held, LAYERS, EXPERTS)
    np.testing.assert_array_equal(gpu % held, np.broadcast_to(np.arange(held), gpu.shape))
    np.testing.assert_array_equal(gpu // held, np.broadcast_to(gpu[:, :1] // held, gpu.shape))
    np.testing.assert_array_equal(mb, np.broadcast_to(mb[:, :1], mb.shape))
    want = rank_tokens(counts.tokens, parallel.tp, parallel.cp)  # [S, n]
    np.testing.assert_array_equal(asm.sample_tokens.reshape(num_s, held), want[:, :held])
    slots = asm.counts.sum(axis=-1)  # [S * held, L]
    np.testing.assert_array_equal(
        slots, np.broadcast_to(asm.sample_tokens[:, None] * counts.top_k, slots.shape)
    )
    if held == n:  # the EP group holds whole groups: every token and routed slot of the batch
        np.testing.assert_array_equal(asm.counts.reshape(num_s, n, LAYERS, EXPERTS).sum(1), counts.counts)
        assert asm.load.sum() == counts.counts.sum()
    # each GPU's routed slots in each micro-batch: its ranks' tokens times top-k, per layer
    per_gpu = np.zeros((asm.load.shape[0], g), dtype=np.int64)
    np.add.at(per_gpu, (asm.local_mb, asm.layout.sample_gpu), asm.sample_tokens)
    routed = asm.load.sum(axis=-1)  # [Mb, L, G]
    np.testing.assert_array_equal(routed, np.broadcast_to(per_gpu[:, None, :] * counts.top_k, routed.shape))


@pytest.mark.parametrize("parallel", [TP2_CP2, TP4_CP4], ids=["tp2cp2", "tp4cp4"])
def test_samples_stay_on_their_groups_as_the_simulator_lays_them(parallel: ParallelDims) -> None:
    counts = _batch()
    cluster, model, _ = _setup(parallel)
    config = ControlPlaneConfig(workers=0, samples_per_microbatch=1)
    asm = assemble_batch(counts.counts, counts.tokens, cluster.num_gpus, config, model, parallel)
    _assert_ranks_on_groups(asm, counts, parallel, cluster.num_gpus)
    ranks, workload = parallel_workload(
        counts, parallel, cluster.num_gpus, 1, None, "balanced", model.attention_span
    )
    np.testing.assert_array_equal(asm.counts, ranks.counts)
    np.testing.assert_array_equal(asm.layout.sample_gpu, workload.sample_gpu)
    np.testing.assert_array_equal(asm.load, workload.load)
    if parallel.group > cluster.num_gpus:  # one sample per micro-batch on all 8 GPUs (MBS 1)
        assert asm.load.shape[0] == counts.num_samples


def test_given_layout_names_tp_cp_groups() -> None:
    counts = _batch()
    cluster, _, _ = _setup(TP2_CP2)
    groups = np.arange(counts.num_samples, dtype=np.int32) % 2
    layout = SampleLayout(
        sample_gpu=groups,
        sample_mb=(np.arange(counts.num_samples) // 2).astype(np.int32),
        mb_batch=np.zeros(counts.num_samples // 2, dtype=np.int32),
    )
    asm = given_layout(layout, counts.counts, cluster.num_gpus, TP2_CP2, counts.tokens, counts.top_k)
    _assert_ranks_on_groups(asm, counts, TP2_CP2, cluster.num_gpus)
    np.testing.assert_array_equal(asm.layout.sample_gpu.reshape(-1, 4)[:, 0], groups * 4)
    with pytest.raises(ValueError, match=r"TP x CP groups \[0, 2\)"):
        bad = SampleLayout(groups + 1, layout.sample_mb, layout.mb_batch)
        given_layout(bad, counts.counts, cluster.num_gpus, TP2_CP2, counts.tokens, counts.top_k)
    with pytest.raises(ValueError, match="needs sample_tokens and top_k"):
        given_layout(layout, counts.counts, cluster.num_gpus, TP2_CP2)


def test_counts_without_whole_routed_slots_are_refused_under_tp_cp() -> None:
    counts = _batch()
    cluster, model, _ = _setup(TP2_CP2)
    broken = counts.counts.copy()
    broken[3, 1, 0] += 1
    config = ControlPlaneConfig(workers=0)
    with pytest.raises(ValueError, match=r"sample 3 \(id order\) routes .* at layer 1"):
        assemble_batch(broken, counts.tokens, cluster.num_gpus, config, model, TP2_CP2)
    # EP only nothing is split, and nothing new is refused
    assemble_batch(broken, counts.tokens, cluster.num_gpus, config, model)


@pytest.mark.parametrize("parallel", [TP2_CP2, TP4_CP4], ids=["tp2cp2", "tp4cp4"])
def test_the_plane_plans_the_ranks_as_the_serial_planner(parallel: ParallelDims) -> None:
    counts = _batch()
    cluster, model, cost = _setup(parallel)
    ranks, workload = parallel_workload(
        counts, parallel, cluster.num_gpus, 2, None, "balanced", model.attention_span
    )
    ctx = batch_context(ranks, workload, 0, cluster, model, cost)
    anneal = AnnealConfig(iterations=50, aggregate_warmup=50, locality=True)
    for make in (
        lambda: relibra_replicate_only(replica_slots=SLOTS),
        lambda: relibra(replica_slots=SLOTS, reorder=anneal),
    ):
        serial = make().plan(ctx)
        config = ControlPlaneConfig(workers=0, samples_per_microbatch=2)
        with ControlPlane.from_planner(make(), cluster, model, cost, config) as cp:
            order = np.random.default_rng(1).permutation(counts.num_samples)
            cp.submit(counts.counts[order], counts.tokens[order], sample_ids=order)
            plan = cp.plans(cp.seal())
        check_plan(plan, ctx, replica_slots=SLOTS)
        for field in ("home", "sample_gpu", "load", "assign", "replicas"):
            np.testing.assert_array_equal(getattr(plan, field), getattr(serial, field), err_msg=field)
        np.testing.assert_array_equal(plan.sample_gpu, ctx.sample_gpu)  # the locality round moves nothing


def test_verl_hook_refuses_a_tp_cp_cost_model() -> None:
    cluster, model, cost = _setup(TP2_CP2)
    settings = VerlSettings(num_gpus=8, samples_per_microbatch=1, mini_batch_size=8, epochs=1)
    with pytest.raises(VerlConfigError, match=r"parallel.tp=2 x parallel.cp=2"):
        VerlReLibraHook(relibra_replicate_only(replica_slots=SLOTS), settings, cluster, model, cost)
