"""The parallel dimensions' terms by hand: the pipeline's bubble and sends, tensor parallelism's collectives
and split GEMMs, the stage split, and the per-GPU memory estimate (relibra/parallel.py,
relibra/cost/pipeline.py, relibra/cost/tensor.py, relibra/cost/memory.py)."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.memory import activation_bytes_per_token, in_flight_microbatches, memory_estimate
from relibra.cost.model import CostModel
from relibra.cost.pipeline import StagePass, bubble_fraction, p2p_send_time, pipelined
from relibra.cost.schedule import simulate_schedule
from relibra.cost.tensor import tp_block_time, tp_group_mean
from relibra.parallel import (
    ParallelDims,
    dense_data_parallel,
    expert_data_parallel,
    layer_chunks,
    stage_layers,
)
from tests.builders import HOPPER, training_spec

NVL = HOPPER.nvlink_bytes_per_s * HOPPER.nvlink_efficiency
NIC = HOPPER.nic_bytes_per_s * HOPPER.nic_efficiency
LAT = HOPPER.alltoall_latency_s
MODEL = ModelSpec(
    name="round", num_layers=4, num_moe_layers=3, hidden=1000, moe_ffn=500, num_experts=8, top_k=2,
    num_heads=4, num_kv_heads=2, head_dim=10, dense_ffn=3000, vocab=5000,
)  # fmt: skip


def test_bubble_is_pp_minus_one_over_vpp_microbatches() -> None:
    assert bubble_fraction(8, 4, 512) == 7 / 2048
    assert bubble_fraction(2, 1, 4) == 1 / 4
    assert bubble_fraction(1, 1, 4) == 0.0


def test_the_pass_runs_each_stage_chunk_and_micro_batch_through_the_schedule() -> None:
    # 4 layers (1 dense first, 3 MoE), pp = 2, vpp = 2: chunks of 1 layer, chunk c on stage c mod 2:
    # stage 0 holds the dense layer (chunk 0) and MoE layer 1 (chunk 2), stage 1 MoE layers 0 and 2.
    parallel = ParallelDims(pp=2, vpp=2)
    assert stage_layers(4, parallel).tolist() == [0, 1, 0, 1]
    chunks = layer_chunks(4, parallel)
    assert chunks.tolist() == [0, 1, 2, 3]
    comp = np.array([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])  # [Mb = 2, L = 3]
    comm = np.full((2, 3), 0.5)
    sp = StagePass(
        comp=comp, comm=comm, dense=np.array([0.25, 0.25]), head=np.array([4.0, 4.0]),
        p2p=np.array([0.1, 0.1]), spread=3.0, overlap=False, contention=0.0,
    )  # fmt: skip
    st = pipelined(chunks, 1, 2, 2, sp, lambda s, first, last, share: (float(s) + 1.0,))
    # by hand, per micro-batch: the chunk's layers, half the sends, the stage's spread over its 4 ops
    work = np.empty((2, 2, 2))
    work[0, 0] = 0.25 + 0.05 + 1.0 / 4  # the dense layer
    work[0, 1] = 2.5 + 0.05 + 1.0 / 4  # MoE layer 1
    work[1, 0] = 1.5 + 0.05 + 2.0 / 4  # MoE layer 0
    work[1, 1] = 3.5 + 0.05 + 2.0 / 4 + 4.0  # MoE layer 2 and the head
    finish = simulate_schedule(work / 3, 2 * work / 3)
    totals = finish + np.array([1.0, 2.0])
    assert st.total == pytest.approx(totals.max(), rel=1e-12) and st.slowest == int(np.argmax(totals))
    busy1 = 10.0 + 8.0 + 0.2 + 2.0
    assert st.total >= busy1 + 2.0  # never faster than the busiest stage's work and its per-step seconds
    assert st.bubble == pytest.approx(finish[st.slowest] - work[st.slowest].sum(), rel=1e-12)
    assert st.p2p == pytest.approx(0.2) and st.per_step == (float(st.slowest) + 1.0,)
    assert st.comm_exposed == pytest.approx(3.0)  # every layer's all-to-all, no overlap


def test_equal_micro_batches_price_the_bubble_formula() -> None:
    """Balanced stages and micro-batches: the schedule's pass is the busy seconds times 1 + bubble."""
    parallel = ParallelDims(pp=2, vpp=1)
    chunks = layer_chunks(4, parallel)  # layers 0-1 on stage 0, 2-3 on stage 1
    mb = 4
    sp = StagePass(
        comp=np.full((mb, 4), 1.0), comm=np.zeros((mb, 4)), dense=np.zeros(mb), head=np.zeros(mb),
        p2p=np.zeros(mb), spread=0.0, overlap=False, contention=0.0,
    )  # fmt: skip
    st = pipelined(chunks, 0, 2, 1, sp, lambda s, first, last, share: ())
    assert st.total == pytest.approx(mb * 2.0 * (1 + bubble_fraction(2, 1, mb)), rel=1e-12)


def test_pipeline_send_and_tensor_parallel_collectives_by_hand() -> None:
    cost = CostModel(ClusterSpec(2, 4, HOPPER), MODEL, parallel=ParallelDims(tp=2, pp=2))
    tokens = np.array([[100, 300, 200, 200, 50, 50, 50, 50]])
    assert p2p_send_time(cost, tokens)[0] == pytest.approx(300 * 1000 * 2 / NIC + LAT, rel=1e-12)
    one_domain = CostModel(ClusterSpec(2, 4, HOPPER, nvl_domain=16), MODEL, parallel=ParallelDims(pp=2))
    assert p2p_send_time(one_domain, tokens)[0] == pytest.approx(300 * 1000 * 2 / NVL + LAT, rel=1e-12)
    # 3 exposed ring collectives, each (tp - 1) shards of the largest shard, plus the latency
    block = tp_block_time(cost.cluster, MODEL, 2, tokens)
    assert block[0] == pytest.approx(3 * (300 * 1000 * 2 / NVL + LAT), rel=1e-12)
    four = tp_block_time(cost.cluster, MODEL, 4, tokens)
    assert four[0] == pytest.approx(3 * (3 * 300 * 1000 * 2 / NVL + LAT), rel=1e-12)
    assert tp_block_time(cost.cluster, MODEL, 1, tokens).tolist() == [0.0]
    assert tp_group_mean(np.array([[1.0, 3.0, 2.0, 6.0]]), 2).tolist() == [[2.0, 4.0]]


def test_tensor_parallel_attention_is_the_group_mean() -> None:
    from relibra.cost.passes import token_work

    cluster = ClusterSpec(1, 4, HOPPER)
    tp = CostModel(cluster, MODEL, training=training_spec(), parallel=ParallelDims(tp=2))
    ep = CostModel(cluster, MODEL, training=training_spec())
    tokens = np.array([[400, 0, 100, 100]])
    pairs = tokens * (tokens + 1) / 2.0
    full = ep.attention_time(tokens, pairs)[0]
    tw = token_work(tp, tokens, pairs)
    assert tw.attn[0, 0] == pytest.approx(max(full[0] + full[1], full[2] + full[3]) / 2, rel=1e-12)
    assert tw.router[0] == ep.router_time(tokens).max()  # sequence parallel: each GPU routes its own tokens
    assert tw.tp_block is not None and tw.tp_block[0] == pytest.approx(3 * (400 * 2000 / NVL + LAT))


def test_layers_split_into_chunks_and_stage_parameters() -> None:
    lay = ParallelDims(pp=8, vpp=4, chunk_layers=(2, *(3,) * 30, 2))  # Qwen3-235B's 94 layers, 32 chunks
    stage = stage_layers(94, lay)
    assert np.bincount(stage).tolist() == [11, 12, 12, 12, 12, 12, 12, 11]  # chunk 31 on stage 7
    with pytest.raises(
        ValueError, match=r"parallel.pp \* parallel.vpp = 8 \* 4 = 32 model chunks do not divide"
    ):
        stage_layers(94, ParallelDims(pp=8, vpp=4))
    with pytest.raises(ValueError, match=r"parallel\.chunk_layers"):
        ParallelDims(pp=2, chunk_layers=(2, 2, 2))
    # stage parameters: 4 layers (1 dense) over pp = 2 (2 layers each) and tp = 2
    cost = CostModel(
        ClusterSpec(1, 4, HOPPER), MODEL, training=training_spec(), parallel=ParallelDims(tp=2, pp=2)
    )
    attn = 1000 * (40 + 2 * 20) + 40 * 1000
    d0, e0 = cost.stage_parameters(0)  # the dense layer and MoE layer 0, the embedding
    assert d0 == pytest.approx((2 * attn + 3 * 1000 * 3000 + 5000 * 1000) / 2 + 2 * 1000 * 2 + 1000 * 8)
    assert e0 == 1 * (8 // 4) * 3 * 1000 * 500
    d1, e1 = cost.stage_parameters(1)  # two MoE layers, the LM head and the final norm
    assert d1 == pytest.approx((2 * attn + 5000 * 1000) / 2 + 2 * 1000 * 2 + 1000 + 2 * 1000 * 8)
    assert e1 == 2 * (8 // 4) * 3 * 1000 * 500
    trivial = CostModel(ClusterSpec(1, 4, HOPPER), MODEL, training=training_spec())
    assert trivial.stage_parameters(0) == (float(MODEL.dense_params), 3 * 2 * 3 * 1000 * 500)


def test_megatron_group_sizes() -> None:
    lay = ParallelDims(dp=2, tp=2, pp=8)
    assert lay.world_size(32) == 512
    assert dense_data_parallel(lay, 32) == 32 and expert_data_parallel(lay, 32) == 2
    with pytest.raises(ValueError, match=r"parallel\.etp=2"):
        ParallelDims(etp=2)
    with pytest.raises(ValueError, match=r"parallel\.vpp=2 needs parallel\.pp > 1"):
        ParallelDims(vpp=2)
    with pytest.raises(ValueError, match=r"parallel\.tp=3 does not divide cluster\.gpus_per_node=8"):
        CostModel(ClusterSpec(1, 8, HOPPER), MODEL, parallel=ParallelDims(tp=3))


def test_memory_estimate_by_hand() -> None:
    """EP 4 on one node, pp = 2, tp = 2, no recompute: every byte of the busiest stage by hand."""
    spec = training_spec(recompute="none")
    cost = CostModel(ClusterSpec(1, 4, HOPPER), MODEL, training=spec, parallel=ParallelDims(tp=2, pp=2))
    tokens, mbs = 1000.0, 8
    est = memory_estimate(cost, tokens, mbs, replica_slots=1)
    h, q, kv, e, k, f = 1000, 40, 20, 8, 2, 500
    attn = 2 * (2 * h + q + 2 * kv) + 4 * 4 + 2 * q
    moe = 2 * 2 * h + 4 * e + k * 2 * (h + 3 * f)
    dense = 2 * (2 * h + 3 * 3000)
    assert activation_bytes_per_token(MODEL, "none", moe=True) == attn + moe
    assert activation_bytes_per_token(MODEL, "none", moe=False) == attn + dense
    dp = 4 // 2  # dense data parallel inside the EP group: G / tp
    stages = []
    for s in (0, 1):
        d, x = cost.stage_parameters(s)
        layers = (attn + dense) + (attn + moe) if s == 0 else 2 * (attn + moe)
        acts = tokens * layers * in_flight_microbatches(cost.parallel, s, mbs)
        acts += tokens * 8 * 2 if s == 0 else tokens * 4 * (h + 5000)
        total = (d + x) * (2 + 2) + 12 * (d / dp + x / 1) + acts + 3 * h * f * 2
        stages.append(total)
    assert (
        in_flight_microbatches(cost.parallel, 0, mbs) == 2
        and in_flight_microbatches(cost.parallel, 1, mbs) == 1
    )
    assert est.total == pytest.approx(max(stages), rel=1e-12)
    assert est.stage == int(np.argmax(stages))
    # interleaving: Megatron's penalty 1 + (pp - 1) / (pp * vpp); fewer micro-batches than stages
    assert in_flight_microbatches(ParallelDims(pp=4, vpp=2), 0, 100) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_microbatches(ParallelDims(pp=4), 0, 2) == 2
    # recompute: selective keeps no core-attention output, full only each layer's input (plus one layer)
    assert activation_bytes_per_token(MODEL, "selective", moe=True) == attn + moe - 2 * q
    assert activation_bytes_per_token(MODEL, "full", moe=True) == 2 * h


def test_memory_estimate_matches_megatrons_weight_and_optimizer_formula() -> None:
    """With fp32 gradients (``grad_reduce_bytes_per_param=4``), EP only: Megatron's
    ``theoretical_memory_usage.py`` charges ``6 + 12 / d`` bytes per parameter, ``d`` the data-parallel size
    of the dense parameters and the expert-data-parallel size of the experts."""
    spec = training_spec(grad_reduce_bytes_per_param=4.0)
    cost = CostModel(ClusterSpec(2, 4, HOPPER), MODEL, training=spec)
    est = memory_estimate(cost, 0.0, 1, 0)
    dense, expert = float(MODEL.dense_params), 3 * (8 // 8) * 3 * 1000 * 500
    assert est.params + est.grads + est.optimizer == pytest.approx(
        dense * (6 + 12 / 8) + expert * (6 + 12 / 1), rel=1e-12
    )
