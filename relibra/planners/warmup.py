"""Compile ReLibra's numba kernels ahead of time, into numba's on-disk cache.

Every ``@njit`` kernel in :mod:`relibra.planners` is declared with ``cache=True``: numba writes the
machine code next to the source (``relibra/planners/__pycache__/*.nbi, *.nbc``, or under
``NUMBA_CACHE_DIR`` when set) and any later process, such as a control-plane worker, loads it in a fraction
of a second instead of compiling for tens of seconds. The cache is keyed by the source file's
modification time, so an edit of a planner module (or a fresh checkout) leaves it cold until one process
compiles again. Run this once after installing or editing, before starting trainers::

    python -m relibra.planners.warmup

It plans one tiny random batch through the same code paths (and hence the same argument types) as the real
planners: the annealing reorderer with its locality round and the greedy replicator. It is idempotent; a
second run only loads the cache.
"""

from __future__ import annotations

import time

import numpy as np

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import BatchContext
from relibra.simulator import batch_context
from relibra.types import SampleCounts
from relibra.workload import build_workload

__all__ = ["compile_kernels", "tiny_context"]

_HARDWARE = HardwareSpec(
    name="warmup",
    bf16_flops=989e12,
    hbm_bytes_per_s=3.35e12,
    nvlink_bytes_per_s=450e9,
    nic_bytes_per_s=50e9,
    gemm_efficiency=0.7,
    gemm_half_tokens=128.0,
    attention_efficiency=0.5,
    alltoall_latency_s=10e-6,
    nvlink_efficiency=0.8,
    nic_efficiency=0.8,
    host_to_device_bytes_per_s=50e9,
)
"""Any hardware works: kernels are compiled per argument type, not per value (so these are round
numbers, not the calibrated rates of ``experiments/conf/cluster/*.yaml``); it has a host link because
ForeMoE's transfer engine (``baselines.warmup``) refuses a cluster without one."""


def tiny_context(seed: int = 0) -> BatchContext:
    """A tiny random batch (2 nodes x 2 GPUs, 8 experts, 2 layers, 16 samples) to plan for compilation."""
    cluster = ClusterSpec(nodes=2, gpus_per_node=2, hardware=_HARDWARE)
    model = ModelSpec(
        name="warmup",
        num_layers=2,
        num_moe_layers=2,
        hidden=64,
        moe_ffn=32,
        num_experts=8,
        top_k=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    rng = np.random.default_rng(seed)
    num_samples = 16
    tokens = rng.integers(8, 64, size=num_samples).astype(np.int64)
    counts = np.stack([rng.multinomial(2 * int(t), np.full(8, 1 / 8), size=2) for t in tokens]).astype(
        np.int32
    )  # [S, L, E]
    sample_counts = SampleCounts(
        counts=counts, tokens=tokens, batch_offsets=np.array([0, num_samples], dtype=np.int64), top_k=2
    )
    cost = CostModel(cluster, model)
    workload = build_workload(
        sample_counts, cluster.num_gpus, samples_per_microbatch=2, span=model.attention_span
    )
    return batch_context(sample_counts, workload, 0, cluster, model, cost)


def compile_kernels(seed: int = 0) -> dict[str, float]:
    """Run every compiled kernel of the planners once on :func:`tiny_context`.

    Returns seconds per step: ``relibra`` (reordering with the locality round, then greedy replication)
    and ``reorder_only``; seconds of a step are compile time when the cache was cold, load time otherwise.
    """
    from relibra.planners.compose import relibra
    from relibra.planners.reorder.config import AnnealConfig
    from relibra.planners.reorder_only import ReorderOnlyPlanner

    ctx = tiny_context(seed)
    reorder = AnnealConfig(iterations=20, aggregate_warmup=20, locality=True, seeds=(0,))
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    relibra(replica_slots=2, reorder=reorder).plan(ctx)
    seconds["relibra"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ReorderOnlyPlanner(reorder=reorder).plan(ctx)
    seconds["reorder_only"] = time.perf_counter() - t0
    return seconds


def main() -> None:
    t0 = time.perf_counter()
    steps = compile_kernels()
    detail = ", ".join(f"{name} {secs:.2f}s" for name, secs in steps.items())
    print(f"relibra numba kernels ready in {time.perf_counter() - t0:.2f}s ({detail})")


if __name__ == "__main__":
    main()
