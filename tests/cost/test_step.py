"""The whole step's terms (relibra/cost/step.py) and how they join (relibra/cost/passes.py), each against
a hand computation on round numbers."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.cost.passes import LayerWork, TokenWork, forward_pass, update_pass
from relibra.cost.step import TrainingSpec, parallel_groups
from relibra.parallel import ParallelDims
from tests.builders import HOPPER

MODEL = ModelSpec(
    name="round", num_layers=3, num_moe_layers=2, hidden=1000, moe_ffn=500, num_experts=8, top_k=2,
    num_heads=4, num_kv_heads=2, head_dim=10, dense_ffn=3000, vocab=5000,
)  # fmt: skip
SPEC = TrainingSpec(
    recompute="none", recompute_modules=("core_attn",), overlap_grad_reduce=True, overlap_param_gather=True,
    distributed_optimizer=True, norm_values_per_hidden=20.0, norm_forward_values_per_hidden=2.0,
    embedding_values_per_hidden=5.0, permute_values_per_hidden=8.0, swiglu_values_per_ffn=8.0,
    swiglu_forward_values_per_ffn=3.0, router_bytes_per_logit=24.0, loss_bytes_per_logit=8.0,
    optimizer_bytes_per_param=28.0, grad_reduce_bytes_per_param=2.0, param_gather_bytes_per_param=2.0,
    host_overhead_s=1e-5, fp8_recipe="tensorwise", cuda_graph="none",
)  # fmt: skip
HBM = 3.35e12 * 0.85
DENSE = 989e12 * 0.5
NIC = 50e9 * 0.8
NVL = 450e9 * 0.8


def cost(nodes: int = 2, gpn: int = 2, spec: TrainingSpec = SPEC, **cluster: object) -> CostModel:
    return CostModel(ClusterSpec(nodes, gpn, HOPPER, **cluster), MODEL, training=spec)  # type: ignore[arg-type]


def test_head_router_norm_permute_and_core_attention_by_hand() -> None:
    c, t = cost(), np.array([1000.0, 2000.0])
    head = 6 * 1000 * 5000 * t / DENSE + t * 5000 * 8 / HBM + t * 1000 * 5 * 2 / HBM
    np.testing.assert_allclose(c.head_time(t), head, rtol=1e-12)
    head_fwd = 2 * 1000 * 5000 * t / DENSE + 0.5 * (t * 5000 * 8 + t * 1000 * 5 * 2) / HBM
    np.testing.assert_allclose(c.head_forward_time(t), head_fwd, rtol=1e-12)
    np.testing.assert_allclose(c.router_time(t), 6 * 1000 * 8 * t / DENSE + t * 8 * 24 / HBM, rtol=1e-12)
    np.testing.assert_allclose(c.norm_time(t), t * 1000 * 20 * 2 / HBM, rtol=1e-12)
    received = np.array([[300.0, 0.0]])
    np.testing.assert_allclose(
        c.permute_time(received), received * (1000 * 8 + 500 * 8) * 2 / HBM, rtol=1e-12
    )
    pairs = np.array([5.0e5])
    np.testing.assert_allclose(c.core_attention_time(pairs), 3 * 4 * 5.0e5 * 4 * 10 / DENSE, rtol=1e-12)


@pytest.mark.parametrize(
    ("recipe", "bytes_per_value"),
    [("delayed", 4.0), ("tensorwise", 6.0), ("mxfp8", 2 + 2 * 33 / 32), ("blockwise", 2 + 2 * 132 / 128)],
)
def test_fp8_casts_by_hand(recipe: str, bytes_per_value: float) -> None:
    """Each FP8 GEMM casts its input forward and its output gradient backward: the experts ``2 h + 3 f``
    values per received slot; attention ``2 h + 2 q + 2 kv`` per token, plus the dense FFN's ``2 h + 3 F``
    on a dense layer (this model has no shared experts). bf16 casts nothing."""
    fp8 = cost(spec=replace(SPEC, fp8_recipe=recipe), precision="fp8")
    received, tokens = np.array([[300.0, 0.0]]), np.array([100.0, 50.0])
    np.testing.assert_allclose(
        fp8.expert_cast_time(received), received * (2 * 1000 + 3 * 500) * bytes_per_value / HBM, rtol=1e-12
    )
    attention = 2 * 1000 + 2 * 40 + 2 * 20
    np.testing.assert_allclose(
        fp8.dense_cast_time(tokens), tokens * attention * bytes_per_value / HBM, rtol=1e-12
    )
    np.testing.assert_allclose(
        fp8.dense_cast_time(tokens, moe_layer=False),
        tokens * (attention + 2 * 1000 + 3 * 3000) * bytes_per_value / HBM,
        rtol=1e-12,
    )
    bf16 = cost(spec=replace(SPEC, fp8_recipe=recipe))
    assert not bf16.expert_cast_time(received).any() and not bf16.dense_cast_time(tokens).any()


def test_parameters_optimizer_and_gradient_collectives_by_hand() -> None:
    c = cost(nodes=2, gpn=2)  # G = 4 = DP; EDP = 1
    groups = parallel_groups(c.cluster)
    assert (groups.dp, groups.edp) == (4, 1)
    attention = 1000 * (40 + 2 * 20) + 40 * 1000
    dense = 2 * 5000 * 1000 + 3 * attention + (2 * 1000 * 3 + 1000) + 1000 * 8 * 2 + 3 * 1000 * 3000 * 1
    assert MODEL.dense_params == dense
    expert = 2 * (8 // 4) * 3 * 1000 * 500
    assert c.params_per_gpu() == (dense / 4, expert)
    assert c.optimizer_time() == pytest.approx((dense / 4 + expert) * 28 / HBM, rel=1e-12)
    # a ring over 4 GPUs of 2 nodes: 3/4 of the buffer through each rail NIC, plus one latency
    assert c.grad_reduce_time() == pytest.approx(0.75 * dense * 2 / NIC + 10e-6, rel=1e-12)
    assert c.param_gather_time() == pytest.approx(0.75 * dense * 2 / NIC + 10e-6, rel=1e-12)
    one_node = cost(nodes=1, gpn=4)
    assert one_node.grad_reduce_time() == pytest.approx(0.75 * dense * 2 / NVL + 10e-6, rel=1e-12)
    plain = cost(spec=replace(SPEC, distributed_optimizer=False))
    assert plain.params_per_gpu() == (dense, expert)
    assert plain.grad_reduce_time() == pytest.approx(2 * (0.75 * dense * 2 / NIC + 10e-6), rel=1e-12)
    assert plain.param_gather_time() == 0.0
    assert c.launch_time(3, 2.0) == pytest.approx(1e-5 * 2 * 3 * 2)
    # a partial CUDA graph (attention, router) leaves the expert path on the host; a full-iteration one
    # launches nothing from it
    assert cost(spec=replace(SPEC, cuda_graph="partial")).launch_time(3, 2.0) == c.launch_time(3, 2.0)
    assert cost(spec=replace(SPEC, cuda_graph="full_iteration")).launch_time(3, 2.0) == 0.0


def _work() -> tuple[LayerWork, TokenWork]:
    """Two micro-batches, two MoE layers, every number hand-chosen."""
    work = LayerWork(
        compute=np.array([[1.0, 2.0], [3.0, 4.0]]),
        comm=np.array([[0.5, 0.5], [1.0, 1.0]]),
        permute=np.array([[0.1, 0.1], [0.2, 0.2]]),
    )
    tw = TokenWork(
        attn=np.array([[0.3], [0.3]]),
        core_attn=np.array([0.06, 0.06]),
        dense=np.array([0.9, 0.9]),
        router=np.array([0.01, 0.01]),
        norm=np.array([0.02, 0.02]),
        head=np.array([0.4, 0.4]),
        head_forward=np.array([0.15, 0.15]),
    )
    return work, tw


def test_update_pass_joins_every_term_by_hand() -> None:
    c = cost()
    work, tw = _work()
    res = update_pass(c, work, tw, dense_layers=1, fixed=(0.05, 0.0, 0.0, 0.0))
    comp = work.compute + 0.3 + work.permute + 0.03  # [Mb, L]
    moe = comp.sum() + work.comm.sum()
    rs, ag = c.grad_reduce_time(), c.param_gather_time()
    per_mb = comp.sum(axis=1) + work.comm.sum(axis=1) + (0.9 + 0.02) + 0.4
    rs_exp, ag_exp = max(rs - 2 * per_mb[-1] / 3, 0.0), max(ag - per_mb[0] / 3, 0.0)
    launch = 1e-5 * 2 * 2 * 2
    other = 0.8 + 0.01 * 2 * 2 + 0.02 * 2 * 3 + launch + c.optimizer_time() + rs_exp + ag_exp
    expected = moe + 0.05 + 1.8 + (0.02 * 2 + 0.8 + launch + c.optimizer_time() + rs_exp + ag_exp)
    assert res.total == pytest.approx(expected, rel=1e-12)
    assert res.parts["t_other_s"] == pytest.approx(other, rel=1e-12)
    assert res.parts["t_permute_s"] == pytest.approx(0.6)
    assert res.comm_exposed == pytest.approx(3.0)
    exposed = update_pass(cost(spec=replace(SPEC, overlap_grad_reduce=False, overlap_param_gather=False)),
                          work, tw, 1, (0.05, 0.0, 0.0, 0.0))  # fmt: skip
    assert exposed.parts["t_grad_reduce_s"] == pytest.approx(rs) and exposed.parts["t_param_gather_s"] == ag


def _tiny_work() -> tuple[LayerWork, TokenWork]:
    """:func:`_work` a million times smaller: micro-batches of microseconds, shorter than the collectives."""
    work, tw = _work()
    small = {f: getattr(tw, f) * 1e-6 for f in ("attn", "core_attn", "dense", "router", "norm", "head")}
    return (
        replace(work, compute=work.compute * 1e-6, comm=work.comm * 1e-6, permute=work.permute * 1e-6),
        replace(tw, **small, head_forward=tw.head_forward * 1e-6),
    )


def test_host_time_widens_the_collectives_overlap_window_by_hand() -> None:
    """The reduce-scatter hides behind the last micro-batch's backward and the all-gather behind the first
    one's forward, host time included: with 2 MoE layers, no recompute and h host seconds per layer and
    direction, each window is h * 2 longer than the GPU's third (or two thirds) of the micro-batch."""
    work, tw = _tiny_work()
    comp = work.compute + 0.3e-6 + work.permute + 0.03e-6
    per_mb = comp.sum(axis=1) + work.comm.sum(axis=1) + (0.9e-6 + 0.02e-6) + 0.4e-6
    for h in (0.0, 1e-5, 1e-3):
        c = cost(spec=replace(SPEC, host_overhead_s=h))
        rs, ag = c.grad_reduce_time(), c.param_gather_time()
        assert rs > 2 * per_mb[-1] / 3 + 2e-5 and ag > per_mb[0] / 3 + 2e-5  # exposed at h = 1e-5
        res = update_pass(c, work, tw, dense_layers=1, fixed=(0.0, 0.0, 0.0, 0.0))
        assert res.parts["t_grad_reduce_s"] == pytest.approx(
            max(rs - (2 * per_mb[-1] / 3 + h * 2), 0.0), rel=1e-12
        )
        assert res.parts["t_param_gather_s"] == pytest.approx(
            max(ag - (per_mb[0] / 3 + h * 2), 0.0), rel=1e-12
        )
    assert res.parts["t_grad_reduce_s"] == 0.0 and res.parts["t_param_gather_s"] == 0.0  # h = 1e-3 hides both
    # full recompute: the backward's window holds two directions (the recomputed forward and the backward)
    c = cost(spec=replace(SPEC, host_overhead_s=1e-5, recompute="full"))
    full = update_pass(c, work, tw, dense_layers=1, fixed=(0.0, 0.0, 0.0, 0.0))
    none = update_pass(
        cost(spec=replace(SPEC, host_overhead_s=0.0, recompute="full")), work, tw, 1, (0.0,) * 4
    )
    assert full.parts["t_grad_reduce_s"] == pytest.approx(
        none.parts["t_grad_reduce_s"] - 1e-5 * 2 * 2, rel=1e-12
    )
    assert full.parts["t_param_gather_s"] == pytest.approx(
        none.parts["t_param_gather_s"] - 1e-5 * 2, rel=1e-12
    )


def test_host_time_widens_each_stages_window_by_its_share_of_the_moe_layers() -> None:
    """Two stages, the dense layer and one MoE layer on the first, the other MoE layer on the second: the
    slowest stage's (the first's) window grows by its half of the MoE layers' host time, h per direction."""
    work, tw = _tiny_work()
    parallel = ParallelDims(pp=2, chunk_layers=(2, 1))
    models = [
        CostModel(
            ClusterSpec(2, 2, HOPPER), MODEL, training=replace(SPEC, host_overhead_s=h), parallel=parallel
        )
        for h in (0.0, 1e-5)
    ]
    got = [update_pass(c, work, tw, 1, (0.0, 0.0, 0.0, 0.0)).parts for c in models]
    assert got[0]["t_grad_reduce_s"] > 1e-5 and got[0]["t_param_gather_s"] > 1e-5
    assert got[1]["t_grad_reduce_s"] == pytest.approx(got[0]["t_grad_reduce_s"] - 1e-5, rel=1e-9)
    assert got[1]["t_param_gather_s"] == pytest.approx(got[0]["t_param_gather_s"] - 1e-5, rel=1e-9)


@pytest.mark.parametrize("parallel", [None, ParallelDims(pp=3)])
def test_fp8_casts_join_the_update_and_forward_by_hand(parallel: ParallelDims | None) -> None:
    """Hand-chosen casts: each MoE layer's expert casts [Mb, L] and dense ones [Mb], each dense layer's.
    The update's ``t_fp8_cast_s`` sums them, and the update prices them as that much more per-layer work
    (the same seconds as the permutation and the dense layers carrying them), with and without a pipeline
    (one layer per stage); without one, and with the collectives not overlapped, the update grows by them
    and a forward-only pass by half of them."""
    work, tw = _work()
    cast = np.array([[0.01, 0.02], [0.03, 0.04]])
    cast_moe, cast_dense = np.array([0.005, 0.005]), np.array([0.007, 0.007])
    casting_tw = replace(tw, cast_moe=cast_moe, cast_dense=cast_dense)
    casting = replace(work, cast=cast)
    spec = replace(SPEC, overlap_grad_reduce=False, overlap_param_gather=False)
    c = CostModel(ClusterSpec(2, 2, HOPPER), MODEL, training=spec, parallel=parallel or ParallelDims())
    total = cast.sum() + 0.005 * 2 * 2 + 0.007 * 2 * 1
    plain = update_pass(c, work, tw, 1, (0.0, 0.0, 0.0, 0.0))
    got = update_pass(c, casting, casting_tw, 1, (0.0, 0.0, 0.0, 0.0))
    assert got.parts["t_fp8_cast_s"] == pytest.approx(total, rel=1e-12)
    assert plain.parts["t_fp8_cast_s"] == 0.0
    carried = update_pass(
        c,
        replace(work, permute=work.permute + cast + cast_moe[:, None]),
        replace(tw, dense=tw.dense + cast_dense),
        1,
        (0.0, 0.0, 0.0, 0.0),
    )
    assert got.total == pytest.approx(carried.total, rel=1e-12) and got.total > plain.total
    if parallel is None:
        assert got.total - plain.total == pytest.approx(total, rel=1e-9)
        fwd_plain, fwd = forward_pass(c, work, tw, 1, 0.0), forward_pass(c, casting, casting_tw, 1, 0.0)
        assert fwd - fwd_plain == pytest.approx(0.5 * total, rel=1e-9)


def test_recompute_adds_the_forward_it_repeats() -> None:
    work, tw = _work()
    base = update_pass(cost(), work, tw, 1, (0.0, 0.0, 0.0, 0.0))
    sel = update_pass(cost(spec=replace(SPEC, recompute="selective")), work, tw, 1, (0.0, 0.0, 0.0, 0.0))
    # core attention's forward again: 0.06 / 3 per (micro-batch, MoE layer) and per dense layer
    assert sel.parts["t_recompute_s"] == pytest.approx(0.02 * 4 + 0.02 * 2)
    full = update_pass(cost(spec=replace(SPEC, recompute="full")), work, tw, 1, (0.0, 0.0, 0.0, 0.0))
    comp = work.compute + 0.3 + work.permute + 0.03
    assert full.parts["t_recompute_s"] == pytest.approx(comp.sum() / 3 + work.comm.sum() / 2 + 2 * 0.92 / 3)
    assert full.parts["t_launch_s"] == pytest.approx(1.5 * base.parts["t_launch_s"])
    assert full.comm_exposed == pytest.approx(base.comm_exposed)  # the recompute's all-to-all is its own
    assert full.total > sel.total > base.total


def test_forward_pass_is_a_third_of_gemms_and_half_of_memory_and_comm() -> None:
    work, tw = _work()
    got = forward_pass(cost(), work, tw, dense_layers=1, fixed=0.07)
    comp = (work.compute + 0.3) / 3 + (work.permute + 0.03) / 2
    moe = comp.sum() + work.comm.sum() / 2
    dense = 2 * (0.9 / 3 + 0.02 / 2)
    assert got == pytest.approx(moe + 0.07 + dense + 0.3 + 1e-5 * 2 * 2, rel=1e-12)


def test_moe_step_prices_none_of_the_whole_step() -> None:
    work, tw = _work()
    z = np.zeros(2)
    zero = TokenWork(tw.attn, core_attn=z, dense=tw.dense, router=z, norm=z, head=z, head_forward=z)
    moe_only = cost(spec=replace(SPEC, step="moe", recompute="full"))
    res = update_pass(moe_only, replace(work, permute=np.zeros((2, 2))), zero, 1, (0.05, 0.1, 0.2, 0.3))
    comp = work.compute + 0.3
    assert res.total == comp.sum() + work.comm.sum() + 0.05 + 0.9 * 2 + 0.1 + 0.2 + 0.3
    assert all(v == 0.0 for v in res.parts.values())


def test_fp8_prices_gemms_at_the_fp8_peak_and_dispatch_with_scales() -> None:
    bf16, fp8 = cost(), cost(precision="fp8")
    n = np.array([4096.0])
    flops = 2 * 3 * 1000 * 500 * 4096 * 3
    assert bf16.expert_time(n)[0] == pytest.approx(flops * (4096 + 128) / 4096 / (989e12 * 0.7), rel=1e-12)
    assert fp8.expert_time(n)[0] == pytest.approx(flops * (4096 + 128) / 4096 / (2 * 989e12 * 0.6), rel=1e-12)
    assert bf16.dispatch_token_bytes == 2000 and fp8.dispatch_token_bytes == pytest.approx(
        1000 * (1 + 4 / 128)
    )
    tokens, pairs = np.array([100.0]), np.array([5000.0])
    proj = 2 * MODEL.attention_params * 100.0
    core = 4 * 5000.0 * 4 * 10
    assert fp8.attention_time(tokens, pairs)[0] == pytest.approx(3 * (proj / (2 * DENSE) + core / DENSE))
    lin = fp8.linear()
    assert lin.nvlink_dispatch_s_per_token == pytest.approx(1000 * (1 + 4 / 128) / NVL)
    assert lin.rdma_combine_s_per_token == pytest.approx(2000 / NIC)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"step": "partial"}, "simulator.step='partial'"),
        ({"recompute": "layers"}, "training.recompute='layers'"),
        ({"rl_passes": ("recompute",)}, "workload.rl_passes=['recompute']"),
        ({"rl_passes": ("update", "update")}, "workload.rl_passes"),
        ({"rl_passes": ("update", "rollout")}, "workload.rl_passes"),
        ({"norm_values_per_hidden": -1.0}, "training.norm_values_per_hidden=-1.0"),
        ({"host_overhead_s": "x"}, "training.host_overhead_s='x'"),
        ({"fp8_recipe": "hybrid"}, "training.fp8_recipe='hybrid'"),
        ({"cuda_graph": "full"}, "training.cuda_graph='full'"),
        ({"overlap_grad_reduce": 1}, "training.overlap_grad_reduce=1"),
    ],
)
def test_training_spec_refuses_bad_values(change: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=re.escape(key)):
        replace(SPEC, **change)  # type: ignore[arg-type]


def test_cluster_refuses_unknown_precision_and_fp8_without_its_rates() -> None:
    with pytest.raises(ValueError, match=r"cluster\.precision='fp4'"):
        ClusterSpec(1, 2, HOPPER, precision="fp4")
    with pytest.raises(ValueError, match=r"cluster\.precision=fp8 needs"):
        ClusterSpec(1, 2, replace(HOPPER, fp8_gemm_efficiency=0.0), precision="fp8")
    with pytest.raises(ValueError, match="hbm_efficiency"):
        cost(nodes=1, gpn=2).__class__(ClusterSpec(1, 2, replace(HOPPER, hbm_efficiency=0.0)), MODEL,
                                       training=SPEC).norm_time(np.ones(2))  # fmt: skip


def test_host_overhead_null_takes_the_generation_s_value() -> None:
    """training.host_overhead_s null: the hardware's calibrated host time; a number overrides it."""
    hw = replace(HOPPER, host_overhead_s=2e-3)
    model = CostModel(ClusterSpec(2, 2, hw), MODEL, training=replace(SPEC, host_overhead_s=None))
    assert model.host_overhead() == 2e-3
    assert model.launch_time(3, 2.0) == pytest.approx(2e-3 * MODEL.num_moe_layers * 3 * 2.0)
    own = CostModel(ClusterSpec(2, 2, hw), MODEL, training=replace(SPEC, host_overhead_s=5e-4))
    assert own.host_overhead() == 5e-4
