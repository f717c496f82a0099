"""Selective recompute by module (relibra/cost/recompute.py, ``training.recompute_modules``): each module's
seconds by hand, how they join the update with and without a pipeline, the activations each drops, and
the refusals."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from relibra.cluster import ClusterSpec
from relibra.cost.memory import activation_bytes_per_token
from relibra.cost.model import CostModel
from relibra.cost.passes import LayerWork, TokenWork, token_work, update_pass
from relibra.parallel import ParallelDims
from tests.builders import HOPPER
from tests.cost.test_step import DENSE, HBM, MODEL, SPEC
from tests.cost.test_step import _work as step_work

NO_FIXED = (0.0, 0.0, 0.0, 0.0)


def _work() -> tuple[LayerWork, TokenWork]:
    """test_step's two micro-batches and two MoE layers, with compute in thirds (exact at a third) and the
    recomputed kernels' token work; every number hand-chosen."""
    work, tw = step_work()
    work = replace(work, compute=np.array([[0.6, 1.2], [1.8, 2.4]]))
    tw = replace(
        tw,
        norm_forward=np.array([0.004, 0.004]),
        shared=np.array([0.09, 0.09]),
        dense_ffn=np.array([0.6, 0.6]),
    )
    return work, tw


def _cost(modules: tuple[str, ...], parallel: ParallelDims | None = None, **spec: object) -> CostModel:
    training = replace(SPEC, recompute="selective", recompute_modules=modules, **spec)  # type: ignore[arg-type]
    return CostModel(ClusterSpec(2, 2, HOPPER), MODEL, training=training, parallel=parallel or ParallelDims())


# activation_share of MODEL: SwiGLU's forward, 500 x 3 of the permutation's 1000 x 8 + 500 x 8 values
ACT = 500 * 3 / (1000 * 8 + 500 * 8)
HAND = {
    # per MoE layer: sum over the 2 x 2 (micro-batch, MoE layer) cells; per dense layer: over 2 micro-batches
    ("core_attn",): 0.02 * 4 + 0.02 * 2,
    ("layernorm",): 0.004 * 4,
    ("moe_act",): ACT * 0.6,
    ("shared_experts",): 0.03 * 4,
    ("mlp",): 0.2 * 2,
    # router and permutation at half, the experts and shared experts at a third, half the all-to-all
    ("moe",): 6.0 / 3 + (0.6 + 0.04) / 2 + 0.03 * 4 + 3.0 / 2,
}


@pytest.mark.parametrize("parallel", [None, ParallelDims(pp=3)])
@pytest.mark.parametrize("modules", list(HAND))
def test_each_module_repeats_its_forward_by_hand(
    modules: tuple[str, ...], parallel: ParallelDims | None
) -> None:
    work, tw = _work()
    got = update_pass(_cost(modules, parallel), work, tw, 1, NO_FIXED)
    assert got.parts["t_recompute_s"] == pytest.approx(HAND[modules], rel=1e-12)
    none = update_pass(_cost((), parallel), work, tw, 1, NO_FIXED)
    assert none.parts["t_recompute_s"] == 0.0
    # under the pipeline the dense layer's stage (stage 0 of 3) is not the slowest, so mlp may not show
    assert got.total > none.total if parallel is None else got.total >= none.total
    if parallel is None and modules != ("moe",):  # nothing overlapped: the update grows by exactly that
        assert got.total - none.total == pytest.approx(HAND[modules], rel=1e-9)


def test_modules_add_up_and_moe_contains_its_activation_and_shared_experts() -> None:
    work, tw = _work()
    each = ("core_attn", "layernorm", "moe_act", "shared_experts", "mlp")
    together = update_pass(_cost(each), work, tw, 1, NO_FIXED).parts["t_recompute_s"]
    assert together == pytest.approx(sum(HAND[(m,)] for m in each), rel=1e-12)
    moe = update_pass(_cost(("moe",)), work, tw, 1, NO_FIXED)
    subsumed = update_pass(_cost(("moe", "moe_act", "shared_experts")), work, tw, 1, NO_FIXED)
    assert subsumed.total == moe.total and subsumed.parts == moe.parts


def test_moe_recompute_launches_a_third_direction_and_keeps_exposed_comm_its_own() -> None:
    work, tw = _work()
    moe = update_pass(_cost(("moe",)), work, tw, 1, NO_FIXED)
    act = update_pass(_cost(("moe_act",)), work, tw, 1, NO_FIXED)
    assert moe.parts["t_launch_s"] == pytest.approx(1.5 * act.parts["t_launch_s"])
    # the update's own all-to-all exposed (no overlap: all of it), the recomputed half in t_recompute_s
    assert moe.comm_exposed == pytest.approx(act.comm_exposed) == pytest.approx(work.comm.sum())


def test_a_module_without_its_token_work_is_refused() -> None:
    work, tw = _work()
    with pytest.raises(ValueError, match=re.escape("mlp, which needs TokenWork.dense_ffn")):
        update_pass(_cost(("mlp",)), work, replace(tw, dense_ffn=None), 1, NO_FIXED)


def test_token_work_carries_the_recomputed_kernels_by_hand() -> None:
    c = _cost(("layernorm",))
    tokens, pairs = np.array([[1000.0, 3000.0, 2000.0, 0.0]]), np.array([[5e5, 4e6, 2e6, 0.0]])
    tw = token_work(c, tokens, pairs)
    assert tw.norm_forward is not None and tw.shared is not None and tw.dense_ffn is not None
    np.testing.assert_allclose(tw.norm_forward, [3000 * 1000 * 2 * 2 / HBM], rtol=1e-12)
    np.testing.assert_allclose(tw.dense_ffn, [3 * 2 * 3 * 1000 * 3000 * 3000 / DENSE], rtol=1e-12)
    np.testing.assert_allclose(tw.shared, [0.0])  # MODEL has no shared experts
    shared = replace(MODEL, shared_experts=1, shared_ffn=200)
    cs = CostModel(c.cluster, shared, training=c.training)
    np.testing.assert_allclose(
        cs.shared_expert_time(tokens), 3 * 2 * 3 * 1000 * 200 * tokens / DENSE, rtol=1e-12
    )
    assert c.activation_share() == pytest.approx(ACT, rel=1e-15)


def test_each_module_drops_the_activations_it_recomputes() -> None:
    m = replace(MODEL, shared_experts=1, shared_ffn=200)
    h, q, kv, e, k, f, s, d = 1000, 40, 20, 8, 2, 500, 200, 3000
    attn = 2 * (2 * h + q + 2 * kv) + 4 * 4 + 2 * q
    moe = 2 * 2 * h + 4 * e + k * 2 * (h + 3 * f) + 2 * 3 * s
    dense = 2 * (2 * h + 3 * d)

    def got(modules: tuple[str, ...], is_moe: bool = True) -> float:
        return activation_bytes_per_token(m, "selective", moe=is_moe, modules=modules)

    assert got(()) == activation_bytes_per_token(m, "none", moe=True) == attn + moe
    assert got(("core_attn",)) == attn + moe - 2 * q
    assert got(("layernorm",)) == attn + moe - 2 * h
    assert got(("moe_act",)) == attn + moe - k * 2 * f
    assert got(("shared_experts",)) == attn + moe - 2 * 3 * s
    assert got(("moe",)) == attn + 2 * 2 * h
    assert got(("moe", "layernorm")) == attn + 2 * h
    assert got(("mlp",), is_moe=False) == attn + 2 * h
    assert got(("mlp", "layernorm"), is_moe=False) == attn + dense - dense + 2 * h  # dense norms fused
    assert got(("moe_act",), is_moe=False) == attn + dense
    # recompute none or full ignores the modules
    assert activation_bytes_per_token(m, "none", moe=True, modules=("moe",)) == attn + moe


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"recompute_modules": ("attention",)}, "a list of distinct modules from"),
        ({"recompute_modules": ("moe_act", "moe_act")}, "a list of distinct modules from"),
        ({"recompute_modules": "moe_act"}, "training.recompute_modules='moe_act': must be a list"),
        ({"recompute": "none", "recompute_modules": ("moe_act",)}, "only with training.recompute=selective"),
        ({"recompute": "full", "recompute_modules": ()}, "only with training.recompute=selective"),
    ],
)
def test_training_spec_refuses_bad_modules(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(replace(SPEC, recompute="selective"), **change)  # type: ignore[arg-type]


def test_modules_are_kept_as_a_tuple_and_the_default_is_accepted_everywhere() -> None:
    spec = replace(SPEC, recompute="selective", recompute_modules=["layernorm", "moe_act"])  # type: ignore[arg-type]
    assert spec.recompute_modules == ("layernorm", "moe_act")
    for recompute in ("none", "selective", "full"):
        assert replace(SPEC, recompute=recompute).recompute_modules == ("core_attn",)
