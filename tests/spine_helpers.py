"""Tiny clusters, models and workloads for the spine's tests (and any planner test that wants them)."""

from __future__ import annotations

import numpy as np

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import BatchContext
from relibra.simulator import batch_context
from relibra.types import SampleCounts, Workload
from relibra.workload import build_workload


def hand_hardware(
    name: str, bf16_flops: float, hbm_bytes_per_s: float, nvlink_bytes_per_s: float, nic_bytes_per_s: float
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
    )


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
