"""The tests' shared builders, in one place: tiny clusters, models, workloads and batch contexts,
hand-made traces and planner contexts, and Hydra-composed configs. Fixtures built on them are in
``tests/conftest.py``."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from hydra import compose, initialize_config_dir

import experiments  # noqa: F401  (registers the planner config nodes cfg() composes, as the CLI does)
from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours, microbatch_share
from relibra.cost.step import TrainingSpec
from relibra.invariants import sample_loads
from relibra.planners.protocols import BatchContext
from relibra.planners.replicate.terms import ReplicationCoefficients
from relibra.simulator import batch_context
from relibra.trace.format import RoutingTrace
from relibra.types import SampleCounts, Workload
from relibra.workload import build_workload, gpu_token_stats, microbatch_loads

REPO = Path(__file__).resolve().parents[1]
CONF = str(REPO / "experiments" / "conf")
"""The Hydra config directory (a string, as ``initialize_config_dir`` takes it)."""


def hand_hardware(
    name: str,
    bf16_flops: float,
    hbm_bytes_per_s: float,
    nvlink_bytes_per_s: float,
    nic_bytes_per_s: float,
    host_to_device_bytes_per_s: float = 64e9,
) -> HardwareSpec:
    """A hand-built :class:`HardwareSpec` with these peak rates and round efficiencies.

    NOTE: the efficiencies are not the calibrated ones of ``experiments/conf/cluster/*.yaml`` (NVLink
    0.685, NIC 0.875, fitted to DeepEP's tables): the tests that use this hardware check relations (plans
    against the cost model, planners against each other), not rates; the rates are tested against their
    fit in tests/experiments/test_validate.py.
    """
    return HardwareSpec(
        name=name,
        bf16_flops=bf16_flops,
        hbm_bytes_per_s=hbm_bytes_per_s,
        nvlink_bytes_per_s=nvlink_bytes_per_s,
        nic_bytes_per_s=nic_bytes_per_s,
        gemm_efficiency=0.7,
        gemm_half_tokens=128.0,
        attention_efficiency=0.5,
        alltoall_latency_s=10e-6,
        nvlink_efficiency=0.8,
        nic_efficiency=0.8,
        host_to_device_bytes_per_s=host_to_device_bytes_per_s,
        fp8_flops=2 * bf16_flops,
        fp8_gemm_efficiency=0.6,
        hbm_efficiency=0.85,
        sms=132,
    )


ROUND_RATES_HW = HardwareSpec(
    name="hand",
    bf16_flops=1e12,
    hbm_bytes_per_s=1e12,
    nvlink_bytes_per_s=200e9,
    nic_bytes_per_s=20e9,
    gemm_efficiency=0.5,
    gemm_half_tokens=10.0,
    attention_efficiency=0.5,
    alltoall_latency_s=1e-6,
    nvlink_efficiency=0.5,  # effective 100 GB/s
    nic_efficiency=0.5,  # effective 10 GB/s
)
"""Round rates for hand-computed seconds: NVLink 100 GB/s and the NIC 10 GB/s effective, 1 TFLOP/s peak,
no host link (``host_to_device_bytes_per_s`` 0; ``replace`` it where a test needs one)."""
ROUND_NVL = 100e9
ROUND_NIC = 10e9

ROUND_MODEL = ModelSpec(
    name="hand",
    num_layers=1,
    num_moe_layers=1,
    hidden=4,
    moe_ffn=2,
    num_experts=4,
    top_k=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    dense_ffn=8,
)
"""One MoE layer of 4 experts, top-1, hidden 4, expert FFN 2: weights small enough to price by hand
(an expert's three bf16 matrices are 48 bytes)."""

TINY_CELL = [
    "model=olmoe-1b-7b",
    "trace.num_batches=1",
    "trace.samples_per_batch=8",
    "trace.max_tokens=64",
    "cluster.nodes=1",
    "cluster.gpus_per_node=4",
]
"""Overrides of a cell small enough to compose, check and run in a test (OLMoE, one batch of 8 samples of
at most 64 tokens, 4 GPUs)."""


def training_spec(**overrides: Any) -> TrainingSpec:
    """The :class:`TrainingSpec` of ``experiments/conf/training/megatron.yaml`` (the one place its constants
    are written), with ``overrides`` (``step``, ``rl_passes``, ``recompute``, ...)."""
    from omegaconf import OmegaConf

    conf: Any = OmegaConf.to_container(OmegaConf.load(REPO / "experiments/conf/training/megatron.yaml"))
    return TrainingSpec(**{**conf, **overrides})


HOPPER = hand_hardware("test-hopper", 989e12, 3.35e12, 450e9, 50e9)
"""H100 SXM5 datasheet peaks (dense bf16, HBM3, NVLink and one 400 Gb/s NIC per direction)."""


def tiny_model(num_experts: int = 8, num_layers: int = 2, top_k: int = 2) -> ModelSpec:
    return ModelSpec(
        name="tiny",
        num_layers=num_layers,
        num_moe_layers=num_layers,
        hidden=64,
        moe_ffn=32,
        num_experts=num_experts,
        top_k=top_k,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )


def random_counts(
    num_samples: int = 16,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    num_batches: int = 2,
    seed: int = 0,
    skew: float = 1.5,
) -> SampleCounts:
    """Skewed per-sample counts: expert popularity ~ Zipf(skew), shuffled per layer."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(5, 60, size=num_samples).astype(np.int64)
    pop = 1.0 / np.arange(1, num_experts + 1) ** skew
    counts = np.zeros((num_samples, num_layers, num_experts), dtype=np.int32)
    for l in range(num_layers):
        p = rng.permutation(pop / pop.sum())
        counts[:, l] = [rng.multinomial(int(t) * top_k, p) for t in tokens]
    offsets = np.linspace(0, num_samples, num_batches + 1).astype(np.int64)
    return SampleCounts(counts=counts, tokens=tokens, batch_offsets=offsets, top_k=top_k)


def tiny_setup(
    nodes: int = 2,
    gpus_per_node: int = 2,
    num_experts: int = 8,
    samples_per_microbatch: int = 2,
    seed: int = 0,
) -> tuple[SampleCounts, Workload, ClusterSpec, ModelSpec, CostModel]:
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, hardware=HOPPER)
    model = tiny_model(num_experts=num_experts)
    counts = random_counts(num_experts=num_experts, seed=seed)
    workload = build_workload(counts, cluster.num_gpus, samples_per_microbatch=samples_per_microbatch)
    return counts, workload, cluster, model, CostModel(cluster, model)


def tiny_context(batch: int = 0, **kwargs: int) -> BatchContext:
    counts, workload, cluster, model, cost = tiny_setup(**kwargs)
    return batch_context(counts, workload, batch, cluster, model, cost)


def make_trace(
    seed: int = 0, tokens: int = 300, layers: int = 3, experts: int = 8, k: int = 2
) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    # Distinct top-k per token: argsort of random keys.
    routes = np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :k].astype(np.int16)
    cuts = np.sort(rng.choice(np.arange(1, tokens), 11, replace=False))
    return RoutingTrace(
        experts=routes,
        sample_offsets=np.r_[0, cuts, tokens].astype(np.int64),
        batch_offsets=np.array([0, 5, 12], dtype=np.int64),
        sample_domain=(np.arange(12) % 2).astype(np.int16),
        domain_names=("math", "code"),
        meta={"num_experts": experts, "top_k": k, "num_layers": layers, "model": "toy", "source": "test"},
    )


def make_ctx(
    *,
    nodes: int = 2,
    gpus_per_node: int = 4,
    num_experts: int = 16,
    num_layers: int = 3,
    microbatches: int = 2,
    samples: int = 32,
    top_k: int = 2,
    skew: float = 0.3,
    seed: int = 0,
    history: int = 0,
    nvl_domain: int | None = None,
) -> BatchContext:
    """A small consistent BatchContext: skewed per-sample counts and the loads they give (NVLink domains of
    ``nvl_domain`` GPUs; None: one per node)."""
    rng = np.random.default_rng(seed)
    g = nodes * gpus_per_node
    popularity = rng.dirichlet(np.full(num_experts, skew), size=num_layers)  # [L, E]
    tokens = rng.integers(20, 200, size=samples)
    counts = np.stack(
        [np.stack([rng.multinomial(t * top_k, popularity[l]) for l in range(num_layers)]) for t in tokens]
    ).astype(np.int32)  # [S, L, E]
    sample_gpu = (np.arange(samples) % g).astype(np.int32)
    sample_mb = ((np.arange(samples) // g) % microbatches).astype(np.int32)
    load = sample_loads(counts, sample_gpu, sample_mb, microbatches, g).astype(np.int32)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, hardware=HOPPER, nvl_domain=nvl_domain)
    model = ModelSpec(
        name="tiny",
        num_layers=num_layers,
        num_moe_layers=num_layers,
        hidden=256,
        moe_ffn=128,
        num_experts=num_experts,
        top_k=top_k,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
    )
    past = tuple(
        np.asarray(rng.poisson(load.astype(np.float64) + 1.0), dtype=np.int32) for _ in range(history)
    )
    return BatchContext(
        batch=len(past),
        counts=counts,
        sample_tokens=tokens.astype(np.int64),
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        load=load,
        cluster=cluster,
        model=model,
        cost=CostModel(cluster, model),
        history=past,
    )


def layer_ctx(
    nodes: int,
    gpus_per_node: int,
    num_experts: int,
    *,
    num_layers: int = 2,
    microbatches: int = 3,
    samples_per_gpu: int = 2,
    seed: int = 0,
    alpha: float = 0.3,
    prev_home: np.ndarray | None = None,
) -> BatchContext:
    """A consistent BatchContext: Dirichlet-skewed per-sample counts, samples round-robin over GPUs."""
    rng = np.random.default_rng(seed)
    cost = make_cost(nodes, gpus_per_node, num_experts, num_layers)
    g = cost.cluster.num_gpus
    k = cost.model.top_k
    sb = microbatches * g * samples_per_gpu
    tokens = rng.integers(64, 512, size=sb).astype(np.int64)
    topic = rng.dirichlet(np.full(num_experts, alpha), size=(4, num_layers))  # [topics, L, E]
    which = rng.integers(0, 4, size=sb)
    counts = np.stack(
        [[rng.multinomial(tokens[s] * k, topic[which[s], l]) for l in range(num_layers)] for s in range(sb)]
    ).astype(np.int32)
    sample_gpu = (np.arange(sb) % g).astype(np.int32)
    sample_mb = (np.arange(sb) // (g * samples_per_gpu)).astype(np.int32)

    def regroup(new_gpu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        load = microbatch_loads(counts, new_gpu, sample_mb, microbatches, g)
        return load, gpu_token_stats(tokens, new_gpu, sample_mb, microbatches, g)[0]

    return BatchContext(
        batch=0,
        counts=counts,
        sample_tokens=tokens,
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        load=regroup(sample_gpu)[0],
        cluster=cost.cluster,
        model=cost.model,
        cost=cost,
        prev_home=prev_home,
        seed=seed,
        regroup=regroup,
    )


def cfg(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def file_cfg(trace_file: Path, *more: str):
    return cfg(
        f"trace.path={trace_file}",
        "model=olmoe-1b-7b",
        "cluster.nodes=2",
        "cluster.gpus_per_node=8",
        "workload.samples_per_microbatch=1",
        *more,
    )


@cache
def planner_config(name: str) -> Any:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[f"planner={name}"]).planner


def make_cost(
    nodes: int,
    gpus_per_node: int,
    num_experts: int,
    num_layers: int = 2,
    top_k: int = 4,
    ep_overlap: bool = False,
) -> CostModel:
    """A Qwen3-30B-A3B-shaped expert (hidden 2048, FFN 768) on ``nodes x gpus_per_node`` H100s."""
    model = ModelSpec(
        name="test-moe",
        num_layers=num_layers,
        num_moe_layers=num_layers,
        hidden=2048,
        moe_ffn=768,
        num_experts=num_experts,
        top_k=top_k,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
    )
    return CostModel(ClusterSpec(nodes, gpus_per_node, HOPPER, ep_overlap=ep_overlap), model)


def plan_share(
    load: np.ndarray, assign: np.ndarray, home: np.ndarray, cost: CostModel, overlap: OverlapNeighbours
) -> np.ndarray:
    """float64 [P]: each problem's share of the overlapped layer time (:func:`microbatch_share`) of a plan,
    priced by the cost model's functions: linearised compute (busiest GPU, attention added) and the
    dispatcher's communication (latency included). load [P, G, E], assign [P, E, G], home [P, E]."""
    coef = ReplicationCoefficients.from_cost(cost)
    a = np.asarray(assign, dtype=np.float64)
    copies = (a > 0) | (np.arange(cost.cluster.num_gpus) == np.asarray(home)[..., None])
    comp = (a.sum(axis=-2) + coef.fixed_tokens * copies.sum(axis=-2)).max(axis=-1) * coef.seconds_per_token
    comm = cost.moe_comm_time(load, assign).max(axis=-1)
    return np.array(
        [
            microbatch_share(c + overlap.attention[l], k, overlap.neighbours[l], math.inf, overlap.contention)
            for l, (c, k) in enumerate(zip(comp, comm, strict=True))
        ]
    )
