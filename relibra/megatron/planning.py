"""The control plane between rollout and training: recorded routes -> batch context -> batch plan.

Recorded routes of each sample (``[T_s, L, k]``, :func:`relibra.megatron.replay.recorded_routes`) become a
:class:`~relibra.trace.format.RoutingTrace`, per-sample counts (:class:`~relibra.types.SampleCounts`), a
:class:`~relibra.types.Workload` (samples balanced over GPUs and cut into micro-batches) and the
:class:`~relibra.planners.protocols.BatchContext` any ReLibra planner takes. The training side then asks
:func:`microbatch_samples` which samples each rank trains in each micro-batch (the plan may move samples
between GPUs) and replays their routes in that order.

**Tensor and context parallelism** (``parallel``, a :class:`~relibra.parallel.ParallelDims`; default EP
only, every array as before): the workload is :func:`relibra.workload.parallel_workload`'s, as the
simulator's: every sample becomes the ``h`` ranks of its TP x CP group the EP group holds (``h = tp * cp``,
or ``G`` when the group is wider than the EP group: :func:`relibra.parallel.ep_group_ranks`), whole samples
go to TP x CP groups, and rank ``r`` of a sample sits on GPU ``group * h + r`` (row ``s * h + r`` of the
context). A rank holds Megatron's chunk of the sequence (:func:`rank_token_ranges`: CP rank ``i`` the chunks
``i`` and ``2 cp - 1 - i`` of ``2 cp``, concatenated, then its TP rank's ``1 / tp`` of them under sequence
parallelism; the token counts of :func:`relibra.workload.rank_tokens`). Since the routes record every
token, a rank's counts here are the exact counts of the tokens it holds, not the even share that
:func:`relibra.workload.split_counts` gives per-sample counts (the layout depends on tokens only, so it is
the same either way). A GPU replays its rank's tokens of each of its samples (:func:`microbatch_samples`,
:func:`group_rank`, :func:`rank_routes`), and the context's loads count exactly those.

Used by ``examples/megatron_rl_step.py`` and the equivalence tests of ``tests/executors/test_megatron.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.model import CostModel
from relibra.parallel import ParallelDims, ep_group_ranks
from relibra.planners.protocols import BatchContext, Planner
from relibra.types import BatchPlan

__all__ = [
    "gpu_skew",
    "group_rank",
    "load_hardware",
    "microbatch_samples",
    "plan_routes",
    "planning_specs",
    "rank_routes",
    "rank_token_ranges",
    "routes_context",
]


def load_hardware(path: str | PathLike[str]) -> HardwareSpec:
    """The ``hardware`` block of a cluster config (``experiments/conf/cluster/*.yaml``). A value that names
    the code's default (``${default:cluster.hardware.KEY}``, the suite's config) is left to
    :class:`HardwareSpec`'s own default, which is the one it names."""
    from omegaconf import OmegaConf

    conf: Any = OmegaConf.to_container(OmegaConf.load(Path(path)))
    if not isinstance(conf, dict) or "hardware" not in conf:
        raise ValueError(f"{path}: expected a cluster config with a 'hardware' block")
    given = {
        k: v for k, v in conf["hardware"].items() if not (isinstance(v, str) and v.startswith("${default:"))
    }
    return HardwareSpec(**given)


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
    parallel: ParallelDims | None = None,
) -> BatchContext:
    """Recorded routes of one batch's samples (int ``[T_s, L, k]`` each, in sample order) -> its context.

    Routes -> trace -> counts -> workload (:func:`relibra.workload.parallel_workload`: samples balanced over
    ``cluster.num_gpus``, micro-batches of ``samples_per_microbatch`` samples or ``tokens_per_microbatch``
    tokens per GPU; per TP x CP group under ``parallel``) -> batch context 0, priced by a cost model of
    ``parallel`` (None: :class:`~relibra.parallel.ParallelDims`'s defaults, EP only). Under ``tp * cp > 1``
    the context's rows are ranks (module doc): ``counts`` int32 [S * h, L, E] the exact counts of each rank's
    tokens, ``sample_tokens`` int64 [S * h] :func:`relibra.workload.rank_tokens`' for the ranks held.
    """
    from relibra.megatron.replay import routes_to_trace
    from relibra.simulator import batch_context
    from relibra.workload import microbatch_loads, parallel_workload

    parallel = parallel if parallel is not None else ParallelDims()
    trace = routes_to_trace(sample_routes, model.num_experts, model=model.name)
    if trace.num_layers != model.num_layers or trace.top_k != model.top_k:
        raise ValueError(
            f"routes hold L={trace.num_layers}, k={trace.top_k}; the model spec says "
            f"L={model.num_layers}, k={model.top_k}"
        )
    g = cluster.num_gpus
    cost = CostModel(cluster, model, parallel=parallel)
    ranks, workload = parallel_workload(
        trace.to_counts(),
        parallel,
        g,
        samples_per_microbatch,
        tokens_per_microbatch,
        span=model.attention_span,
    )
    if parallel.group > 1:
        exact = _rank_counts(sample_routes, parallel, ep_group_ranks(parallel, g), model.num_experts)
        ranks = replace(ranks, counts=exact)
        load = microbatch_loads(exact, workload.sample_gpu, workload.sample_mb, workload.num_microbatches, g)
        workload = replace(workload, load=load)
    return batch_context(ranks, workload, 0, cluster, model, cost)


def plan_routes(
    sample_routes: Sequence[np.ndarray],
    planner: Planner,
    cluster: ClusterSpec,
    model: ModelSpec,
    samples_per_microbatch: int | None = None,
    tokens_per_microbatch: int | None = None,
    parallel: ParallelDims | None = None,
) -> tuple[BatchPlan, BatchContext]:
    """:func:`routes_context`, then ``planner.plan``: the batch plan and the context it was planned from."""
    ctx = routes_context(
        sample_routes, cluster, model, samples_per_microbatch, tokens_per_microbatch, parallel
    )
    return planner.plan(ctx), ctx


def microbatch_samples(
    sample_gpu: np.ndarray,
    sample_mb: np.ndarray,
    rank: int,
    m: int,
    *,
    parallel: ParallelDims | None = None,
    num_gpus: int | None = None,
) -> np.ndarray:
    """The samples GPU ``rank`` of the EP group trains in micro-batch ``m``, ascending: int64 ``[n]``.

    ``sample_gpu`` int [S'] is the plan's (``plan.sample_gpu``), ``sample_mb`` int [S'] the context's
    (``ctx.sample_mb``, local to the batch). A rank replays these samples' routes concatenated in this
    order, which is the order ``plan.load`` counts them in.

    Under ``parallel`` with ``tp * cp > 1`` (``num_gpus``, the EP group's ``G``, is then needed) the rows
    are ranks, ``S' = S * h`` (module doc): the samples returned are whole-sample indices (row ``// h``),
    and GPU ``rank`` trains only its rank's tokens of each (:func:`group_rank`, :func:`rank_token_ranges`,
    :func:`rank_routes`); a row of another rank on this GPU raises :class:`ValueError`.
    """
    sample_gpu, sample_mb = np.asarray(sample_gpu), np.asarray(sample_mb)
    if sample_gpu.shape != sample_mb.shape or sample_gpu.ndim != 1:
        raise ValueError(
            f"sample_gpu {sample_gpu.shape} and sample_mb {sample_mb.shape}: expected two arrays of shape [S]"
        )
    rows = np.flatnonzero((sample_gpu == rank) & (sample_mb == m)).astype(np.int64)
    parallel = parallel if parallel is not None else ParallelDims()
    if parallel.group == 1:
        return rows
    if num_gpus is None:
        raise ValueError(
            f"microbatch_samples: parallel.tp * parallel.cp = {parallel.group} > 1 needs num_gpus (the EP "
            "group's G) to tell a sample's ranks apart"
        )
    held = ep_group_ranks(parallel, num_gpus)
    if sample_gpu.size % held:
        raise ValueError(
            f"sample_gpu has {sample_gpu.size} rows, not whole samples of {held} ranks (parallel.tp * "
            f"parallel.cp = {parallel.group} over an EP group of {num_gpus} GPUs)"
        )
    wrong = rows[rows % held != rank % held]
    if wrong.size:
        s = int(wrong[0])
        raise ValueError(
            f"sample_gpu puts rank {s % held} of sample {s // held} on GPU {rank}, which holds rank "
            f"{rank % held} of its TP x CP group: a plan must move whole TP x CP groups"
        )
    return rows // held


def group_rank(gpu: int, parallel: ParallelDims, num_gpus: int, ep_group: int = 0) -> int:
    """The rank (``cp_rank * tp + tp_rank``) in its TP x CP group of GPU ``gpu`` of an EP group of
    ``num_gpus`` GPUs: ``gpu mod tp * cp`` when the EP group holds whole groups; when a group is wider
    (:func:`relibra.parallel.ep_group_ranks`), GPU ``gpu`` of the ``ep_group``-th of the ``tp * cp / G`` EP
    groups it spans holds rank ``ep_group * G + gpu`` (the context holds EP group 0's, module doc)."""
    held, n = ep_group_ranks(parallel, num_gpus), parallel.group
    spans = n // held
    if not 0 <= gpu < num_gpus or not 0 <= ep_group < spans:
        raise ValueError(
            f"gpu={gpu}, ep_group={ep_group}: expected a GPU in [0, {num_gpus}) and an EP group in [0, "
            f"{spans}) of the TP x CP group of {n} GPUs"
        )
    return ep_group * held + gpu % held


def rank_token_ranges(sample_tokens: np.ndarray, parallel: ParallelDims) -> np.ndarray:
    """int64 [S, tp * cp, 2, 2]: the token ranges ``[start, stop)`` of each sample that each rank of its TP x
    CP group holds (rank ``cp_rank * tp + tp_rank``), at most two per rank, in the order the rank holds them.

    CP rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` of the ``2 cp`` chunks (chunk ``c`` is tokens
    ``floor(t c / 2cp) .. floor(t (c + 1) / 2cp)``; Megatron-core ``get_batch_on_this_cp_rank``), the two
    concatenated; sequence parallelism gives its TP rank ``j`` positions ``floor(h j / tp) .. floor(h (j +
    1) / tp)`` of those ``h`` tokens, which may straddle both chunks. Without CP (``cp = 1``) the rank's one
    range is its TP part of the whole sample and the second range is empty (``start == stop``). The lengths
    are :func:`relibra.workload.rank_tokens`' exactly; the ranges of all ranks tile ``[0, t)``.
    """
    t = np.asarray(sample_tokens, dtype=np.int64)[:, None]  # [S, 1]
    tp, cp = parallel.tp, parallel.cp
    if cp > 1:
        bound = t * np.arange(2 * cp + 1) // (2 * cp)  # [S, 2cp + 1]
        i = np.arange(cp)
        a0, a1 = bound[:, i], bound[:, i + 1]  # [S, cp]: chunk i
        b0, b1 = bound[:, 2 * cp - 1 - i], bound[:, 2 * cp - i]  # chunk 2cp - 1 - i
    else:
        a0, a1 = np.zeros_like(t), t
        b0, b1 = t, t
    len_a = (a1 - a0)[..., None]  # [S, cp, 1]
    cut = ((a1 - a0) + (b1 - b0))[..., None] * np.arange(tp + 1) // tp  # [S, cp, tp + 1]
    q0, q1 = cut[..., :-1], cut[..., 1:]  # [S, cp, tp]: the TP rank's part of the held tokens
    first = np.stack([a0[..., None] + np.minimum(q0, len_a), a0[..., None] + np.minimum(q1, len_a)], -1)
    second = np.stack(
        [b0[..., None] + np.maximum(q0 - len_a, 0), b0[..., None] + np.maximum(q1 - len_a, 0)], -1
    )
    return np.stack([first, second], axis=-2).reshape(t.shape[0], cp * tp, 2, 2)


def rank_routes(
    sample_routes: Sequence[np.ndarray], samples: np.ndarray, parallel: ParallelDims, rank: int
) -> np.ndarray:
    """The routes rank ``rank`` of a TP x CP group replays for ``samples`` (from :func:`microbatch_samples`):
    each sample's :func:`rank_token_ranges` of that rank, concatenated in sample order, int64 [T', L, k]
    (``np.concatenate([sample_routes[s] for s in samples])`` when ``tp = cp = 1``)."""
    if not 0 <= rank < parallel.group:
        raise ValueError(f"rank={rank}: expected a rank in [0, {parallel.group}) of the TP x CP group")
    if not sample_routes:
        raise ValueError("sample_routes is empty; expected the recorded routes of the batch's samples")
    picked = [np.asarray(sample_routes[int(s)]) for s in samples]
    ranges = rank_token_ranges(np.array([len(r) for r in picked], dtype=np.int64), parallel)[:, rank]
    shape = np.shape(sample_routes[0])[1:]
    parts = [np.zeros((0, *shape), dtype=np.int64)]
    parts += [r[a:b] for r, spans in zip(picked, ranges) for a, b in spans]
    return np.concatenate(parts).astype(np.int64)


def _rank_counts(
    sample_routes: Sequence[np.ndarray], parallel: ParallelDims, held: int, num_experts: int
) -> np.ndarray:
    """int32 [S * held, L, E]: the exact expert counts of the tokens the first ``held`` ranks of each sample
    hold (:func:`rank_token_ranges`), rank ``r`` of sample ``s`` at row ``s * held + r``."""
    lengths = np.array([len(r) for r in sample_routes], dtype=np.int64)
    ranges = rank_token_ranges(lengths, parallel)[:, :held]  # [S, held, 2, 2]
    num_l = int(np.shape(sample_routes[0])[1])
    out = np.empty((lengths.size * held, num_l, num_experts), dtype=np.int32)
    size = held * num_l * num_experts
    for s, routes in enumerate(sample_routes):
        owner = np.full(lengths[s], -1, dtype=np.int64)
        for r in range(held):
            for a, b in ranges[s, r]:
                owner[a:b] = r
        mine = owner >= 0
        keys = (owner[mine, None, None] * num_l + np.arange(num_l)[None, :, None]) * num_experts
        keys = keys + np.asarray(routes, dtype=np.int64)[mine]
        out[s * held : (s + 1) * held] = np.bincount(keys.ravel(), minlength=size).reshape(
            held, num_l, num_experts
        )
    return out


def gpu_skew(assign: np.ndarray) -> np.ndarray:
    """Max / mean compute tokens per GPU: ``assign [..., E, G]`` -> float64 ``[...]``."""
    per_gpu = np.asarray(assign).sum(axis=-2).astype(np.float64)
    return per_gpu.max(axis=-1) / np.maximum(per_gpu.mean(axis=-1), 1e-9)
