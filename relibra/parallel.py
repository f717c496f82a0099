"""The parallel dimensions around the EP group (glossary: parallel dimensions).

``cluster.nodes x cluster.gpus_per_node`` is **one pipeline stage's EP group**, ``G`` GPUs, the GPUs every
planner balances; a planner's plan applies to every stage's layers (each stage balances its own layers
over its own ``G`` GPUs the same way). Around it, as Megatron-core lays ranks out
(``megatron/core/parallel_state.py: initialize_model_parallel``, the dense mesh ``TP x CP x DP x PP`` and
the expert mesh ``ETP x EP x EDP x PP`` over the same ranks):

* ``parallel.tp``: tensor parallelism *inside* the EP group. Its ``G`` GPUs are ``G / tp`` tensor-parallel
  groups of ``tp`` consecutive GPUs (one node's NVLink: ``tp`` divides ``cluster.gpus_per_node``); each group
  is one dense data-parallel rank. With sequence parallelism (which Megatron requires for MoE with TP) each
  GPU holds ``1 / tp`` of its group's tokens, and those are the tokens it routes and dispatches.
* ``parallel.cp``: context parallelism (Megatron's ``context_parallel_size``) inside the EP group, next
  outward from ``tp`` in Megatron's rank order (``tp-cp-ep-dp-pp``): a TP x CP group is ``tp * cp``
  consecutive GPUs, its CP ranks ``tp`` apart, so a group larger than a node spans ``tp * cp /
  gpus_per_node`` whole nodes (:meth:`ParallelDims.describe`). Each sequence is cut into ``2 * cp``
  chunks and CP rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i`` (the load-balanced split of causal
  attention: Megatron-core ``get_batch_on_this_cp_rank``, Transformer Engine
  ``attention/dot_product_attention/context_parallel.py``), then sequence parallelism gives each of its
  ``tp`` GPUs ``1 / tp`` of those tokens: every GPU holds ``1 / (tp * cp)`` of its group's tokens and
  routes them (:mod:`relibra.workload`, :mod:`relibra.cost.context`).
* ``parallel.etp``: expert tensor parallelism; the experts of one stage are spread over ``ep = G / etp``
  ranks. Only ``etp = 1`` is modelled (every Megatron-Bridge MoE performance recipe sets
  ``expert_tensor_parallel_size = 1``; Megatron's own default, ``etp = tp``, is refused with a message).
* ``parallel.pp`` stages of ``G`` GPUs each make the pipeline, ``parallel.vpp`` model chunks per stage
  (Megatron's interleaved 1F1B schedule); :func:`stage_layers` says which layers each stage holds.
* ``parallel.dp`` replicas of the whole pipeline multiply it.

The run trains on ``dp * pp * G`` GPUs (:meth:`ParallelDims.world_size`). Megatron's group sizes follow:
data parallel ``world / (tp * cp * pp) = dp * G / (tp * cp)`` (:func:`dense_data_parallel`: one rank per TP
x CP group, the size Megatron divides the global batch by), the dense gradients' reduction group
``world / (tp * pp)`` (data parallel with CP, since CP ranks hold the same weights), expert data parallel
``world / (etp * ep * pp) = dp``. The EP group of a stage is its ``G`` consecutive ranks (``etp = 1``): it
holds ``G / (tp * cp)`` whole TP x CP groups when ``tp * cp`` divides ``G``; when a TP x CP group is larger
(Megatron-MoE-ModelZoo's Qwen3-235B-A22B at 64K: TP 4 x CP 4 = 16 GPUs over EP 8), ``G`` must divide it and
each EP group holds ``G`` consecutive ranks of one TP x CP group: ``G / tp`` of its CP ranks, every sample of
the micro-batch in part (:func:`ep_group_ranks`). The EP groups of one TP x CP group then route disjoint
chunks of the same sequences; the simulator prices the first (CP ranks ``0 .. G / tp - 1``), and the others
hold the same number of tokens (Megatron's chunks differ by at most one token) and the same causal attention
work (the load-balanced split), so it stands for all of them (choice left open: their routing differs only
by which positions they hold, which per-sample counts do not record). Megatron's micro-batch is
``MBS`` samples per TP x CP group, and a step runs ``GBS / (MBS * data parallel)`` of them
(:func:`megatron_microbatches`, ``megatron/core/num_microbatches_calculator.py``). The defaults (every
size 1) are EP only, as in earlier releases.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from relibra.attention_span import AttentionSpan

__all__ = [
    "PARALLEL_KEYS",
    "ParallelDims",
    "dense_data_parallel",
    "ep_group_ranks",
    "expert_data_parallel",
    "layer_chunks",
    "layer_split_problem",
    "megatron_microbatches",
    "rank_span",
    "stage_layers",
]


@dataclass(frozen=True)
class ParallelDims:
    """The ``parallel.*`` keys; every default here is the one default."""

    dp: int = 1
    """Data-parallel replicas of the pipeline (``parallel.dp``)."""
    tp: int = 1
    """Tensor-parallel size inside the EP group (``parallel.tp``); divides ``cluster.gpus_per_node``."""
    cp: int = 1
    """Context-parallel size inside the EP group (``parallel.cp``; module doc): each sequence over ``cp``
    ranks, ``tp`` apart."""
    pp: int = 1
    """Pipeline stages, each its own EP group of ``G`` GPUs (``parallel.pp``)."""
    vpp: int = 1
    """Model chunks per stage of the interleaved schedule (``parallel.vpp``; 1: plain 1F1B)."""
    etp: int = 1
    """Expert tensor parallelism (``parallel.etp``); only 1 is modelled (module docstring)."""
    chunk_layers: tuple[int, ...] | None = None
    """Layers of each of the ``pp * vpp`` model chunks in model order (``parallel.chunk_layers``; None: an
    equal split, which ``pp * vpp`` must divide): Megatron's ``pipeline_model_parallel_layout`` without its
    embedding and loss marks, e.g. ``[2, 3, ..., 3, 2]`` for ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split`` (:func:`stage_layers`)."""
    gpus: int | None = None
    """The GPUs the run is meant to train on (``parallel.gpus``; None: not stated). When set it must equal
    :meth:`world_size`, so sizes that do not multiply to it are refused."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "pp", "vpp", "etp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel.{name}={value!r}: expected an integer >= 1")
        g = self.gpus
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 1):
            raise ValueError(f"parallel.gpus={g!r}: expected an integer >= 1 or null")
        chunks = self.chunk_layers
        if chunks is not None:
            if (
                not isinstance(chunks, tuple)
                or len(chunks) != self.pp * self.vpp
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in chunks)
            ):
                raise ValueError(
                    f"parallel.chunk_layers={list(chunks) if isinstance(chunks, tuple) else chunks!r}: "
                    f"expected parallel.pp * parallel.vpp = {self.pp * self.vpp} integers >= 1 (layers per "
                    "model chunk, model order) or null"
                )
        if self.etp != 1:
            raise ValueError(
                f"parallel.etp={self.etp}: expert tensor parallelism is not modelled (only 1; the "
                "Megatron-Bridge MoE performance recipes set expert_tensor_parallel_size=1)"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"parallel.vpp={self.vpp} needs parallel.pp > 1 (model chunks of a pipeline)")

    @property
    def trivial(self) -> bool:
        """Whether nothing but data parallelism surrounds the EP group (EP only, as in earlier releases)."""
        return self.tp == 1 and self.cp == 1 and self.pp == 1

    @property
    def group(self) -> int:
        """GPUs of one TP x CP group, ``tp * cp``: the GPUs that share each micro-batch's samples."""
        return self.tp * self.cp

    def world_size(self, g: int) -> int:
        """GPUs the run trains on for a stage's EP group of ``g`` GPUs: ``dp * pp * g``."""
        return self.dp * self.pp * g

    def describe(self, g: int, gpus_per_node: int | None = None) -> str:
        """One line: the mapping and the GPU count it implies (printed at the start of a run); with
        ``gpus_per_node``, which nodes a TP x CP group larger than a node spans."""
        n = self.group
        span = (
            f"; a TP x CP group spans {n // gpus_per_node} nodes (CP ranks {self.tp} GPUs apart), and each "
            f"EP group is {g // gpus_per_node} consecutive nodes holding {g // n} such groups"
            if gpus_per_node and n > gpus_per_node and n <= g
            else ""
        )
        inside = (
            f"tp={self.tp} x cp={self.cp} inside it: {g // n} TP x CP groups of {n} consecutive GPUs{span}"
            if n <= g
            else f"tp={self.tp} x cp={self.cp} over it: each TP x CP group of {n} consecutive GPUs spans "
            f"{n // g} EP groups, each holding {g // self.tp} of its CP ranks"
        )
        return (
            f"parallel dimensions: EP group G={g} GPUs per stage (ep={g // self.etp}, {inside}), "
            f"pp={self.pp} stages x vpp={self.vpp} chunks, dp={self.dp} replicas: "
            f"{self.dp} x {self.pp} x {g} = {self.world_size(g)} GPUs; data parallel "
            f"{dense_data_parallel(self, g)}, expert data parallel {expert_data_parallel(self, g)}"
        )


PARALLEL_KEYS = tuple(f.name for f in fields(ParallelDims))
"""The keys of ``parallel.*``."""


def ep_group_ranks(parallel: ParallelDims, g: int) -> int:
    """Ranks of one TP x CP group that one EP group of ``g`` GPUs holds (module doc): ``tp * cp`` when it
    divides ``g`` (whole groups), ``g`` when ``g`` divides ``tp * cp`` (part of one group, its first ``g``
    ranks); :class:`ValueError` when neither divides the other."""
    n = parallel.group
    if g % n == 0:
        return n
    if n % g == 0:
        return g
    raise ValueError(
        f"a TP x CP group of parallel.tp * parallel.cp = {parallel.tp} * {parallel.cp} = {n} GPUs and the EP "
        f"group of {g} GPUs: neither divides the other, so Megatron's rank mesh would cut TP x CP groups "
        "unevenly over EP groups"
    )


def expert_data_parallel(parallel: ParallelDims, ep: int) -> int:
    """Megatron's expert-data-parallel size ``world / (etp * ep * pp)``: ``dp`` (``ep = G / etp``)."""
    world = parallel.world_size(ep * parallel.etp)
    return world // (parallel.etp * ep * parallel.pp)


def dense_data_parallel(parallel: ParallelDims, g: int) -> int:
    """Megatron's data-parallel size ``world / (tp * cp * pp)``: ``dp * G / (tp * cp)``, one rank per TP x CP
    group (``megatron/core/parallel_state.py``, ``get_data_parallel_world_size()``, without CP)."""
    return parallel.world_size(g) // (parallel.tp * parallel.cp * parallel.pp)


def megatron_microbatches(global_batch: int, micro_batch: int, parallel: ParallelDims, g: int) -> int:
    """Micro-batches per step as Megatron computes them: ``GBS / (MBS * data parallel)``
    (``megatron/core/num_microbatches_calculator.py``, ``ConstantNumMicroBatchesCalculator``), which refuses a
    global batch it does not divide (so does this, with :class:`ValueError`)."""
    per = micro_batch * dense_data_parallel(parallel, g)
    if global_batch % per:
        raise ValueError(
            f"global batch {global_batch} is not divisible by micro batch {micro_batch} x data parallel "
            f"{dense_data_parallel(parallel, g)}"
        )
    return global_batch // per


def layer_split_problem(num_layers: int, parallel: ParallelDims) -> str | None:
    """Why the layers cannot be cut into the model chunks (None: they can)."""
    chunks = parallel.pp * parallel.vpp
    if parallel.chunk_layers is not None:
        if sum(parallel.chunk_layers) != num_layers:
            return (
                f"parallel.chunk_layers sums to {sum(parallel.chunk_layers)} layers but model.num_layers="
                f"{num_layers}"
            )
        return None
    if num_layers % chunks:
        return (
            f"parallel.pp * parallel.vpp = {parallel.pp} * {parallel.vpp} = {chunks} model chunks do not "
            f"divide model.num_layers={num_layers}; give the layers of each chunk with parallel.chunk_layers "
            "(as Megatron's pipeline_model_parallel_layout does)"
        )
    return None


def stage_layers(num_layers: int, parallel: ParallelDims) -> np.ndarray:
    """int64 [num_layers]: the pipeline stage of each layer (model order).

    The layers are cut into ``pp * vpp`` contiguous model chunks (virtual stages): ``parallel.chunk_layers``
    layers each, or ``num_layers / (pp * vpp)`` each (refused when that is not whole,
    :func:`layer_split_problem`). Chunk ``c`` runs on stage ``c mod pp`` (Megatron's interleaved
    assignment, ``megatron/core/pipeline_parallel/schedules.py``). The input embedding sits on stage 0 (with
    chunk 0), the LM head and loss on stage ``pp - 1`` (with the last chunk).
    """
    return layer_chunks(num_layers, parallel) % parallel.pp


def layer_chunks(num_layers: int, parallel: ParallelDims) -> np.ndarray:
    """int64 [num_layers]: the model chunk (virtual stage, ``0 .. pp * vpp - 1`` in model order) of each
    layer; chunk ``v`` runs on stage ``v mod pp`` (:func:`stage_layers`)."""
    problem = layer_split_problem(num_layers, parallel)
    if problem:
        raise ValueError(problem)
    chunks = parallel.pp * parallel.vpp
    sizes = parallel.chunk_layers or (num_layers // chunks,) * chunks
    return np.repeat(np.arange(chunks), sizes).astype(np.int64)


def rank_span(span: AttentionSpan, parallel: ParallelDims) -> AttentionSpan:
    """The attention span of one GPU's rank of a sample under ``parallel`` (``span`` itself when ``tp * cp =
    1``; :meth:`relibra.attention_span.AttentionSpan.split`)."""
    return span if parallel.group == 1 else span.split(parallel.group)
