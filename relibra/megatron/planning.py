"""The control plane between rollout and training: recorded routes -> batch context -> batch plan.

Recorded routes of each sample (``[T_s, L, k]``, :func:`relibra.megatron.replay.recorded_routes`) become a
:class:`~relibra.trace.format.RoutingTrace`, per-sample counts (:class:`~relibra.types.SampleCounts`), a
:class:`~relibra.types.Workload` (samples balanced over GPUs and cut into micro-batches) and the
:class:`~relibra.planners.protocols.BatchContext` any ReLibra planner takes. The training side then asks
:func:`microbatch_samples` which samples each rank trains in each micro-batch (the plan may move samples
between GPUs) and replays their routes in that order.

Used by ``examples/megatron_rl_step.py`` and the equivalence tests of ``tests/executors/test_megatron.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import BatchContext, Planner
from relibra.types import BatchPlan

__all__ = [
    "gpu_skew",
    "load_hardware",
    "microbatch_samples",
    "plan_routes",
    "planning_specs",
    "routes_context",
]


def load_hardware(path: str | PathLike[str]) -> HardwareSpec:
    """The ``hardware`` block of a cluster config (``experiments/conf/cluster/*.yaml``)."""
    from omegaconf import OmegaConf

    conf: Any = OmegaConf.to_container(OmegaConf.load(Path(path)))
    if not isinstance(conf, dict) or "hardware" not in conf:
        raise ValueError(f"{path}: expected a cluster config with a 'hardware' block")
    return HardwareSpec(**conf["hardware"])


def planning_specs(
    hardware: HardwareSpec,
    num_gpus: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    hidden: int = 2048,
    ffn: int = 1024,
) -> tuple[ClusterSpec, ModelSpec]:
    """One node of ``num_gpus`` GPUs of ``hardware``, and the model shape the cost model prices.

    The defaults give OLMoE-sized experts (hidden 2048, FFN 1024): on a tiny test model the loads are the
    tiny model's, but the planner should weigh compute against communication as on real hardware, where
    compute, not all-to-all latency, dominates.
    """
    cluster = ClusterSpec(1, num_gpus, hardware)
    model = ModelSpec(
        name=f"megatron-{num_layers}x{num_experts}-priced-as-{hidden}x{ffn}",
        num_layers=num_layers,
        num_moe_layers=num_layers,
        hidden=hidden,
        moe_ffn=ffn,
        num_experts=num_experts,
        top_k=top_k,
        num_heads=16,
        num_kv_heads=16,
        head_dim=hidden // 16,
    )
    return cluster, model


def routes_context(
    sample_routes: Sequence[np.ndarray],
    cluster: ClusterSpec,
    model: ModelSpec,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> BatchContext:
    """Recorded routes of one batch's samples (int ``[T_s, L, k]`` each, in sample order) -> its context.

    Routes -> trace -> counts -> workload (samples balanced over ``cluster.num_gpus``, micro-batches of
    ``samples_per_microbatch`` samples or ``tokens_per_microbatch`` tokens per GPU) -> batch context 0.
    """
    from relibra.megatron.replay import routes_to_trace
    from relibra.simulator import batch_context
    from relibra.workload import build_workload

    trace = routes_to_trace(sample_routes, model.num_experts, model=model.name)
    if trace.num_layers != model.num_layers or trace.top_k != model.top_k:
        raise ValueError(
            f"routes hold L={trace.num_layers}, k={trace.top_k}; the model spec says "
            f"L={model.num_layers}, k={model.top_k}"
        )
    counts = trace.to_counts()
    workload = build_workload(
        counts, cluster.num_gpus, samples_per_microbatch, tokens_per_microbatch, span=model.attention_span
    )
    return batch_context(counts, workload, 0, cluster, model, CostModel(cluster, model))


def plan_routes(
    sample_routes: Sequence[np.ndarray],
    planner: Planner,
    cluster: ClusterSpec,
    model: ModelSpec,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
) -> tuple[BatchPlan, BatchContext]:
    """:func:`routes_context`, then ``planner.plan``: the batch plan and the context it was planned from."""
    ctx = routes_context(sample_routes, cluster, model, samples_per_microbatch, tokens_per_microbatch)
    return planner.plan(ctx), ctx


def microbatch_samples(sample_gpu: np.ndarray, sample_mb: np.ndarray, rank: int, m: int) -> np.ndarray:
    """The samples rank ``rank`` trains in micro-batch ``m``, ascending: int64 ``[n]``.

    ``sample_gpu`` int [S] is the plan's (``plan.sample_gpu``), ``sample_mb`` int [S] the context's
    (``ctx.sample_mb``, local to the batch). A rank replays these samples' routes concatenated in this
    order, which is the order ``plan.load`` counts them in.
    """
    sample_gpu, sample_mb = np.asarray(sample_gpu), np.asarray(sample_mb)
    if sample_gpu.shape != sample_mb.shape or sample_gpu.ndim != 1:
        raise ValueError(
            f"sample_gpu {sample_gpu.shape} and sample_mb {sample_mb.shape}: expected two arrays of shape [S]"
        )
    return np.flatnonzero((sample_gpu == rank) & (sample_mb == m)).astype(np.int64)


def gpu_skew(assign: np.ndarray) -> np.ndarray:
    """Max / mean compute tokens per GPU: ``assign [..., E, G]`` -> float64 ``[...]``."""
    per_gpu = np.asarray(assign).sum(axis=-2).astype(np.float64)
    return per_gpu.max(axis=-1) / np.maximum(per_gpu.mean(axis=-1), 1e-9)
