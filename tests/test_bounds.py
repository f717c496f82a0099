"""Balanced is a bound: on random workloads no planner of experiments/conf/planner beats it in any term.

Every planner config is composed as the entry point composes it and simulated on the same workload;
Balanced is priced on the workload each planner ran on (force-balanced: the same samples, routed
uniformly). Per (micro-batch, layer) the compute and communication terms, per micro-batch the attention,
and the step time must all be at least Balanced's; on the whole step (relibra/cost/step.py, with recompute
and the RL step's forward-only passes) every term and every pass too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baselines.balanced import BalancedBound
from baselines.force_balanced import uniform_routing
from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.parallel import ParallelDims
from relibra.simulator import WHOLE_STEP_COLUMNS, SimResult, simulate
from relibra.workload import build_workload
from tests.builders import HOPPER, planner_config, random_counts, tiny_model, training_spec

BOUNDED_COLUMNS = tuple(
    k for k in WHOLE_STEP_COLUMNS if k not in ("t_grad_reduce_s", "t_param_gather_s", "t_other_s")
)
"""The whole step's columns no plan may push below Balanced's. The exposed gradient reduce-scatter and
parameter all-gather are left out (so ``t_other_s``, their sum with the rest): a slower micro-batch hides
more of them, which the step time still pays for (it is checked)."""
PASSES = ("update",), ("recompute", "update"), ("reference", "recompute", "update")
MODULES = ("core_attn",), ("layernorm", "moe_act", "mlp", "shared_experts"), ("core_attn", "moe")
"""``training.recompute_modules`` under ``selective``: the default, every output-discarding and partial
module, and the whole MoE layer (its all-to-all again)."""

CONF = Path(__file__).resolve().parents[1] / "experiments" / "conf"
PLANNERS = sorted(p.stem for p in (CONF / "planner").glob("*.yaml") if p.stem != "balanced")
RTOL = 1e-9


def _at_least(ours: np.ndarray, bound: np.ndarray, what: str, name: str) -> None:
    short = ours < bound * (1 - RTOL) - 1e-15
    assert not short.any(), (
        f"{name}: {what} below Balanced's at {np.argwhere(short)[:3].tolist()}: "
        f"{ours[short][:3].tolist()} < {bound[short][:3].tolist()}"
    )


def check_bounded(name: str, res: SimResult, bal: SimResult) -> None:
    _at_least(res.t_compute, bal.t_compute, "compute", name)
    _at_least(res.t_comm, bal.t_comm, "communication", name)
    _at_least(res.t_layer_attention, bal.t_layer_attention, "attention", name)
    _at_least(res.batch_time, bal.batch_time, "batch time", name)
    for key in ("step_time_s", "t_compute_s", "t_comm_s", "t_attention_s", *BOUNDED_COLUMNS):
        _at_least(np.array(res.metrics[key]), np.array(bal.metrics[key]), key, name)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    shape=st.sampled_from([(1, 4), (2, 2), (2, 4), (4, 1)]),
    per_gpu=st.sampled_from([1, 2]),
    skew=st.floats(0.0, 2.5),
    samples_per_gpu=st.integers(1, 4),
    layout=st.sampled_from(["balanced", "contiguous"]),
    dispatcher=st.sampled_from(["alltoall", "deepep"]),
    overlap=st.booleans(),
    step=st.sampled_from(["whole", "moe"]),
    recompute=st.sampled_from(["none", "selective", "full"]),
    modules=st.sampled_from(MODULES),
    passes=st.sampled_from(PASSES),
)
def test_no_planner_beats_balanced(
    seed: int,
    shape: tuple[int, int],
    per_gpu: int,
    skew: float,
    samples_per_gpu: int,
    layout: str,
    dispatcher: str,
    overlap: bool,
    step: str,
    recompute: str,
    modules: tuple[str, ...],
    passes: tuple[str, ...],
) -> None:
    from hydra.utils import instantiate

    training = training_spec(
        step=step,
        recompute=recompute,
        recompute_modules=modules if recompute == "selective" else ("core_attn",),
        rl_passes=passes,
    )
    nodes, gpn = shape
    g = nodes * gpn
    model = tiny_model(num_experts=g * per_gpu * 2)
    counts = random_counts(
        num_samples=2 * g * samples_per_gpu, num_experts=model.num_experts, seed=seed, skew=skew
    )
    for name in PLANNERS:
        cfg = planner_config(name)
        run_counts = uniform_routing(counts, seed) if cfg.get("routing") == "uniform" else counts
        work = build_workload(run_counts, g, samples_per_microbatch=2, layout=layout)
        # NOTE: the overlap needs two micro-batches in every step (the entry point refuses it otherwise)
        fewest = min(int(work.batch_microbatches(b).size) for b in range(run_counts.num_batches))
        cluster = ClusterSpec(
            nodes=nodes,
            gpus_per_node=gpn,
            hardware=HOPPER,
            dispatcher=dispatcher,
            ep_overlap=overlap and fewest >= 2,
        )
        cost = CostModel(cluster, model, training=training)
        bal = simulate(BalancedBound(), run_counts, work, cluster, model, cost)
        res = simulate(instantiate(cfg, _convert_="all"), run_counts, work, cluster, model, cost)
        check_bounded(name, res, bal)


MAIN = [
    "megatron",
    "eplb",
    "lplb",
    "popfetcher",
    "ultraep",
    "llep",
    "relibra",
    "force_balanced",
    "relibra_milp",
]


@pytest.mark.parametrize(
    ("dispatcher", "step"), [("alltoall", "moe"), ("deepep", "moe"), ("alltoall", "whole")]
)
@pytest.mark.parametrize("name", MAIN)
def test_main_planners_do_not_beat_balanced(name: str, dispatcher: str, step: str) -> None:
    """The fast companion of the property test: one skewed two-node workload, the main planners; the whole
    step with full recompute and every RL pass."""
    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=HOPPER, dispatcher=dispatcher)
    _check_on_skewed_workload(name, cluster, step)


def _check_on_skewed_workload(name: str, cluster: ClusterSpec, step: str) -> None:
    """Planner ``name`` against Balanced on one skewed workload over ``cluster`` (8 experts, 16 samples, 2
    per GPU and micro-batch), full recompute and every RL pass."""
    from hydra.utils import instantiate

    model = tiny_model(num_experts=8)
    training = training_spec(step=step, recompute="full", rl_passes=PASSES[-1])
    cost = CostModel(cluster, model, training=training)
    counts = random_counts(num_samples=16, num_experts=8, seed=11, skew=2.0)
    cfg = planner_config(name)
    if cfg.get("routing") == "uniform":
        counts = uniform_routing(counts, 0)
    work = build_workload(counts, cluster.num_gpus, samples_per_microbatch=2)
    bal = simulate(BalancedBound(), counts, work, cluster, model, cost)
    res = simulate(instantiate(cfg, _convert_="all"), counts, work, cluster, model, cost)
    check_bounded(name, res, bal)


_TILES = {"gemm_tile_m": 128, "gemm_tile_n": 128, "sms": 132, "expert_launch_s": 5e-6}
"""hopper.yaml's tile, SM and launch settings (relibra/cost/grouped_gemm.py names their sources)."""


@pytest.mark.parametrize(("gemm_model", "per_expert"), [("tiled", False), ("smooth", True), ("tiled", True)])
@pytest.mark.parametrize("name", [*MAIN, "relibra_portfolio", "eplb_periodic", "echo"])
def test_balanced_stays_a_bound_under_tiles_and_per_expert_costs(
    name: str, gemm_model: str, per_expert: bool
) -> None:
    """The opt-in grouped-GEMM terms (``cluster.hardware.gemm_model=tiled``, ``per_expert_costs``): tiles
    and launches reward keeping an expert's tokens together, and Balanced's compute floor
    (:meth:`CostModel.compute_floor`) must stay below every plan's. A tiny model (tiles dominate its
    GEMMs) on a skewed workload, DeepEP and the whole step."""
    from dataclasses import replace

    hardware = replace(HOPPER, gemm_model=gemm_model, per_expert_costs=per_expert, **_TILES)
    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=hardware, dispatcher="deepep")
    _check_on_skewed_workload(name, cluster, "whole")


def test_the_tiled_floor_is_below_every_split() -> None:
    """:meth:`relibra.cost.grouped_gemm.TiledGemm.floor_seconds` against the busiest GPU of random splits of
    the same expert tokens."""
    from dataclasses import replace

    hardware = replace(HOPPER, gemm_model="tiled", **_TILES)
    cost = CostModel(ClusterSpec(nodes=1, gpus_per_node=4, hardware=hardware), tiny_model(num_experts=8))
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = rng.integers(0, 700, size=8)
        share = rng.dirichlet(np.full(4, rng.uniform(0.05, 3.0)), size=8)  # [E, G]
        assign = np.floor(n[:, None] * share)
        assign[:, 0] += n - assign.sum(axis=1)
        floor = cost.compute_floor(n, 4)
        assert floor <= cost.gpu_compute_time(assign).max() * (1 + 1e-12)
    # Where the smooth curve cannot serve as the floor: whole tiles in whole waves (Qwen3-30B-A3B's expert
    # shape, 33 row tiles per expert, two experts per GPU: every kernel's tiles a multiple of 132 SMs) cost
    # exactly the FLOPs under tiles, 128 / 4224 less than the smooth curve charges.
    real = replace(tiny_model(num_experts=8), hidden=2048, moe_ffn=768)
    cost = CostModel(ClusterSpec(nodes=1, gpus_per_node=4, hardware=hardware), real)
    n = np.full(8, 128 * 33)
    assign = np.zeros((8, 4))
    assign[np.arange(8), np.arange(8) // 2] = n
    executed = cost.gpu_compute_time(assign).max()
    assert cost.expert_time(n).sum() / 4 > executed * 1.02  # the smooth floor would not be a bound
    floor = cost.compute_floor(n, 4)
    assert executed * (1 - 1e-9) <= floor <= executed * (1 + 1e-12)  # tight where the waves are full


@pytest.mark.parametrize(
    "parallel", [ParallelDims(pp=2, vpp=2), ParallelDims(tp=2), ParallelDims(tp=2, pp=2)], ids=str
)
@pytest.mark.parametrize("name", ["megatron", "ultraep", "relibra"])
def test_planners_do_not_beat_balanced_under_pipeline_and_tensor_parallelism(
    name: str, parallel: ParallelDims
) -> None:
    """The same skewed workload with every stage's layers on their own EP group, or tensor parallelism
    inside it: the whole step with full recompute and every RL pass."""
    from hydra.utils import instantiate

    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=HOPPER)
    model = tiny_model(num_experts=8, num_layers=4)
    training = training_spec(recompute="full", rl_passes=PASSES[-1])
    cost = CostModel(cluster, model, training=training, parallel=parallel)
    counts = random_counts(num_samples=16, num_layers=4, num_experts=8, seed=11, skew=2.0)
    cfg = planner_config(name)
    if cfg.get("routing") == "uniform":
        counts = uniform_routing(counts, 0)
    work = build_workload(counts, 4, samples_per_microbatch=2)
    bal = simulate(BalancedBound(), counts, work, cluster, model, cost)
    res = simulate(instantiate(cfg, _convert_="all"), counts, work, cluster, model, cost)
    check_bounded(name, res, bal)
    assert (res.metrics["t_bubble_s"] > 0) == (parallel.pp > 1)
    assert (res.metrics["t_tp_comm_s"] > 0) == (parallel.tp > 1)


def test_balanced_attention_is_the_mean() -> None:
    """On a deliberately unbalanced layout Balanced's attention is the per-GPU mean, below the busiest."""
    from baselines.megatron import MegatronPlanner

    cluster = ClusterSpec(nodes=1, gpus_per_node=2, hardware=HOPPER)
    model = tiny_model()
    cost = CostModel(cluster, model)
    counts = random_counts(num_samples=8, num_batches=1, seed=4)
    work = build_workload(counts, 2, samples_per_microbatch=2, layout="contiguous")
    bal = simulate(BalancedBound(), counts, work, cluster, model, cost)
    mega = simulate(MegatronPlanner(), counts, work, cluster, model, cost)
    mean_attn = cost.attention_time(work.tokens.mean(axis=1), work.causal_pairs.mean(axis=1))
    np.testing.assert_allclose(bal.t_layer_attention[:, 0], mean_attn)
    check_bounded("megatron", mega, bal)


def test_balanced_traffic_is_what_no_gpu_can_keep() -> None:
    """Two experts per GPU, no slots: a sample using only its GPU's two experts needs no traffic at all."""
    from baselines.balanced import unavoidable_traffic
    from relibra.simulator import batch_context

    cluster = ClusterSpec(nodes=2, gpus_per_node=1, hardware=HOPPER)
    model = tiny_model(num_experts=4, num_layers=1)
    cost = CostModel(cluster, model)
    local = np.array([[[5, 3, 0, 0]], [[0, 0, 2, 6]]], dtype=np.int32)  # [S=2, L=1, E=4]
    from relibra.types import SampleCounts

    counts = SampleCounts(counts=local, tokens=np.array([4, 4]), batch_offsets=np.array([0, 2]), top_k=2)
    work = build_workload(counts, 2)
    ctx = batch_context(counts, work, 0, cluster, model, cost)
    off_gpu, off_node = unavoidable_traffic(ctx, slots=0)
    assert off_gpu.tolist() == [[0.0]] and off_node.tolist() == [[0.0]]
    spread = SampleCounts(
        counts=np.array([[[2, 2, 2, 2]], [[2, 2, 2, 2]]], dtype=np.int32),
        tokens=np.array([4, 4]),
        batch_offsets=np.array([0, 2]),
        top_k=2,
    )
    ctx = batch_context(spread, build_workload(spread, 2), 0, cluster, model, cost)
    off_gpu, off_node = unavoidable_traffic(ctx, slots=0)
    assert off_gpu.tolist() == [[8.0]] and off_node.tolist() == [[8.0]]  # half of each sample's 8 slots
