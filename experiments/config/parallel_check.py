"""The parallel dimensions' keys and the memory check, before any work
(:func:`experiments.config.checks.check_config`).

:func:`parallel_problems` checks ``parallel.*`` against the cluster and the model (each size an integer >= 1,
``tp`` dividing ``cluster.gpus_per_node`` and the model's heads, ``tp * cp`` dividing the EP group ``G`` or
``G`` dividing it (a TP x CP group over ``tp * cp / G`` EP groups, :func:`relibra.parallel.ep_group_ranks`),
``trace.max_tokens`` a multiple of ``2 * cp * tp`` (of ``tp`` without CP) as Megatron's sequence split needs
(Megatron-core ``get_batch_on_this_cp_rank``; sequence parallelism), the layers cut into ``pp * vpp``
chunks, ``parallel.gpus`` equal to ``dp * pp * G``); :func:`memory_problems` prices the per-GPU bytes of the
parallel dimensions (:func:`relibra.cost.memory.memory_estimate`) against ``cluster.hardware.hbm_bytes`` as
``simulator.memory_check`` says (``error``: a problem; ``warn``: a logged warning; ``off``: nothing), in two
steps: :func:`experiments.config.checks.check_config` checks what needs no input (parameters, gradients,
optimizer state, replica buffer), and :func:`experiments.run.compute` checks it again with the activations of
the workload's largest micro-batch (:func:`workload_memory_problems`) once the inputs are built, before
planning.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from experiments.config.spec import RunSpec
from relibra.cost.memory import MEMORY_CHECKS, memory_estimate
from relibra.cost.model import CostModel
from relibra.parallel import layer_split_problem

__all__ = ["memory_problems", "parallel_problems", "workload_memory_problems"]

log = logging.getLogger(__name__)


def parallel_problems(spec: RunSpec) -> list[str]:
    """What in ``parallel.*`` cannot work with this cluster and model (one message per problem)."""
    parallel = spec.parallel
    try:
        replace(parallel)  # NOTE: ParallelDims's own check (build_spec keeps a refused parallel unchecked)
    except (TypeError, ValueError) as exc:
        return [" ".join(str(exc).split())]
    problems: list[str] = []
    nodes, gpn = spec.cluster.nodes, spec.cluster.gpus_per_node
    if nodes < 1 or gpn < 1:
        return problems  # NOTE: reported by check_config() under cluster.*
    g = nodes * gpn
    if gpn % parallel.tp:
        problems.append(
            f"parallel.tp={parallel.tp} does not divide cluster.gpus_per_node={gpn}: a tensor-parallel group "
            "rides one node's NVLink"
        )
    for key in ("num_heads", "num_kv_heads"):
        heads = getattr(spec.model, key)
        if heads % parallel.tp:
            problems.append(f"parallel.tp={parallel.tp} does not divide model.{key}={heads}")
    n = parallel.group
    if g % n and n % g:
        problems.append(
            f"parallel.tp * parallel.cp = {parallel.tp} * {parallel.cp} = {n} and the EP group "
            f"cluster.nodes * cluster.gpus_per_node = {nodes} * {gpn} = {g}: neither divides the other, so "
            "Megatron's rank mesh would cut the TP x CP groups unevenly over the EP groups"
        )
    elif n > g and (parallel.dp * g) % n:
        problems.append(
            f"parallel.tp * parallel.cp = {n} GPUs span {n // g} EP groups of {g}, but parallel.dp * {g} = "
            f"{parallel.dp * g} GPUs per stage is not a whole number of TP x CP groups: Megatron's data "
            "parallel size (world / (tp * cp * pp)) would not be whole"
        )
    unit = 2 * parallel.cp * parallel.tp if parallel.cp > 1 else parallel.tp
    seq = None if spec.trace.path else spec.trace.max_tokens  # NOTE: a trace file's lengths are its own
    if unit > 1 and seq is not None and seq % unit:
        problems.append(
            f"trace.max_tokens={seq} is not a multiple of "
            + (f"2 * parallel.cp * parallel.tp = 2 * {parallel.cp} * {parallel.tp} = {unit}"
               if parallel.cp > 1 else f"parallel.tp={parallel.tp}")
            + ": Megatron cuts each sequence into 2 * cp chunks (get_batch_on_this_cp_rank) and shards each "
            "CP rank's tokens tp ways (sequence parallelism)"
        )  # fmt: skip
    layers = spec.model.num_layers
    if why := layer_split_problem(layers, parallel):
        problems.append(why)
    if parallel.gpus is not None and parallel.gpus != parallel.world_size(g):
        problems.append(
            f"parallel.gpus={parallel.gpus} but parallel.dp * parallel.pp * (cluster.nodes * "
            f"cluster.gpus_per_node) = {parallel.dp} * {parallel.pp} * ({nodes} * {gpn}) = "
            f"{parallel.world_size(g)}: the parallel sizes do not multiply to the GPUs given"
        )
    return problems


def memory_problems(
    spec: RunSpec, cost: CostModel, tokens_per_gpu: float | None = None, microbatches: int | None = None
) -> list[str]:
    """The memory check (module doc): [] when it fits, warns or is off; else one message naming the keys.

    ``tokens_per_gpu``: the busiest GPU's tokens in its largest micro-batch and ``microbatches`` the most
    micro-batches of a step, from the run's workload; None (:func:`experiments.config.checks.check_config`,
    before any input is read): the check of what needs no workload, the parameters, gradients, optimizer state
    and replica buffer. ``cost``: the run's cost model (its cluster, model, training constants and parallel
    dimensions).
    Call it on a config that passed every other check.
    """

    mode = spec.simulator.memory_check
    if mode not in MEMORY_CHECKS:
        return [f"simulator.memory_check={mode}: choose one of {', '.join(MEMORY_CHECKS)}"]
    if mode == "off":
        return []
    cluster, model = cost.cluster, cost.model
    capacity = cluster.hardware.hbm_bytes
    if not capacity > 0:
        return [
            f"cluster.hardware.hbm_bytes={capacity}: simulator.memory_check={mode} needs the GPU's memory "
            "capacity (set it in the cluster yaml with its source, or simulator.memory_check=off)"
        ]
    slots = int(spec.planner.setting("replica_slots") or 0)
    est = memory_estimate(cost, tokens_per_gpu or 0.0, max(microbatches or 1, 1), slots)
    if est.total <= capacity:
        return []
    par = cost.parallel
    what = (
        f"micro-batches of up to {tokens_per_gpu:.0f} tokens per GPU (workload.samples_per_microbatch / "
        "workload.tokens_per_microbatch, trace.max_tokens)"
        if tokens_per_gpu
        else "before any activation"
    )
    text = (
        f"the configuration does not fit in memory: {est.describe()} > cluster.hardware.hbm_bytes="
        f"{capacity / 1e9:.1f} GB, by {(est.total - capacity) / 1e9:.1f} GB, {what} (model={model.name}, "
        f"EP group cluster.nodes * cluster.gpus_per_node = {cluster.num_gpus}, parallel.tp={par.tp}, "
        f"parallel.cp={par.cp}, parallel.pp={par.pp}, parallel.vpp={par.vpp}, parallel.dp={par.dp}, "
        f"training.recompute={cost.training.recompute if cost.training else None}); raise parallel.pp, "
        "parallel.tp, parallel.cp or the EP group, recompute, shrink the micro-batches, or set "
        "simulator.memory_check=warn"
    )
    if mode == "warn":
        log.warning("%s", text)
        return []
    return [text]


def workload_memory_problems(
    spec: RunSpec, cost: CostModel, tokens: np.ndarray, mb_batch: np.ndarray
) -> list[str]:
    """:func:`memory_problems` for a built workload: tokens [M, G] each GPU holds per micro-batch and
    mb_batch [M] (the batch of each micro-batch)."""
    most = int(np.bincount(np.asarray(mb_batch)).max()) if np.size(mb_batch) else 1
    return memory_problems(spec, cost, float(np.max(tokens)) if np.size(tokens) else 0.0, most)
