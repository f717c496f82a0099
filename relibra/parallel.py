"""The parallel layout around the EP group (glossary: parallel layout).

``cluster.nodes x cluster.gpus_per_node`` is **one pipeline stage's EP group**, ``G`` GPUs, the GPUs every
planner balances; a planner's plan applies to every stage's layers (each stage balances its own layers
over its own ``G`` GPUs the same way). Around it, as Megatron-core lays ranks out
(``megatron/core/parallel_state.py: initialize_model_parallel``, the dense mesh ``TP x CP x DP x PP`` and
the expert mesh ``ETP x EP x EDP x PP`` over the same ranks):

* ``parallel.tp``: tensor parallelism *inside* the EP group. Its ``G`` GPUs are ``G / tp`` tensor-parallel
  groups of ``tp`` consecutive GPUs (one node's NVLink: ``tp`` divides ``cluster.gpus_per_node``); each group
  is one dense data-parallel rank. With sequence parallelism (which Megatron requires for MoE with TP) each
  GPU holds ``1 / tp`` of its group's tokens, and those are the tokens it routes and dispatches.
* ``parallel.etp``: expert tensor parallelism; the experts of one stage are spread over ``ep = G / etp``
  ranks. Only ``etp = 1`` is modelled (every Megatron-Bridge MoE performance recipe sets
  ``expert_tensor_parallel_size = 1``; Megatron's own default, ``etp = tp``, is refused with a message).
* ``parallel.pp`` stages of ``G`` GPUs each make the pipeline, ``parallel.vpp`` model chunks per stage
  (Megatron's interleaved 1F1B schedule); :func:`stage_layers` says which layers each stage holds.
* ``parallel.dp`` replicas of the whole pipeline multiply it.

The run trains on ``dp * pp * G`` GPUs (:meth:`ParallelLayout.world_size`). Megatron's group sizes follow:
dense data parallel ``world / (tp * pp) = dp * G / tp``, expert data parallel
``world / (etp * ep * pp) = dp``. The defaults (every size 1) are the EP-only layout of earlier releases.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = [
    "LAYOUT_KEYS",
    "ParallelLayout",
    "dense_data_parallel",
    "expert_data_parallel",
    "layer_split_problem",
    "stage_layers",
]


@dataclass(frozen=True)
class ParallelLayout:
    """The ``parallel.*`` keys; every default here is the one default."""

    dp: int = 1
    """Data-parallel replicas of the pipeline (``parallel.dp``)."""
    tp: int = 1
    """Tensor-parallel size inside the EP group (``parallel.tp``); divides ``cluster.gpus_per_node``."""
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
    :meth:`world_size`, so a layout whose sizes do not multiply to it is refused."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "vpp", "etp"):
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
        """Whether nothing but data parallelism surrounds the EP group (the layout of earlier releases)."""
        return self.tp == 1 and self.pp == 1

    def world_size(self, g: int) -> int:
        """GPUs the run trains on for a stage's EP group of ``g`` GPUs: ``dp * pp * g``."""
        return self.dp * self.pp * g

    def describe(self, g: int) -> str:
        """One line: the mapping and the GPU count it implies (printed at the start of a run)."""
        return (
            f"parallel layout: EP group G={g} GPUs per stage (ep={g // self.etp}, tp={self.tp} inside it: "
            f"{g // self.tp} tensor-parallel groups), pp={self.pp} stages x vpp={self.vpp} chunks, "
            f"dp={self.dp} replicas: {self.dp} x {self.pp} x {g} = {self.world_size(g)} GPUs; dense data "
            f"parallel {dense_data_parallel(self, g)}, expert data parallel {expert_data_parallel(self, g)}"
        )


LAYOUT_KEYS = tuple(f.name for f in fields(ParallelLayout))
"""The keys of ``parallel.*``."""


def expert_data_parallel(layout: ParallelLayout, ep: int) -> int:
    """Megatron's expert-data-parallel size ``world / (etp * ep * pp)``: ``dp`` (``ep = G / etp``)."""
    world = layout.world_size(ep * layout.etp)
    return world // (layout.etp * ep * layout.pp)


def dense_data_parallel(layout: ParallelLayout, g: int) -> int:
    """Megatron's data-parallel size of the dense parameters ``world / (tp * pp)``: ``dp * G / tp``."""
    return layout.world_size(g) // (layout.tp * layout.pp)


def layer_split_problem(num_layers: int, layout: ParallelLayout) -> str | None:
    """Why the layers cannot be cut into the layout's model chunks (None: they can)."""
    chunks = layout.pp * layout.vpp
    if layout.chunk_layers is not None:
        if sum(layout.chunk_layers) != num_layers:
            return (
                f"parallel.chunk_layers sums to {sum(layout.chunk_layers)} layers but model.num_layers="
                f"{num_layers}"
            )
        return None
    if num_layers % chunks:
        return (
            f"parallel.pp * parallel.vpp = {layout.pp} * {layout.vpp} = {chunks} model chunks do not divide "
            f"model.num_layers={num_layers}; give the layers of each chunk with parallel.chunk_layers (as "
            "Megatron's pipeline_model_parallel_layout does)"
        )
    return None


def stage_layers(num_layers: int, layout: ParallelLayout) -> np.ndarray:
    """int64 [num_layers]: the pipeline stage of each layer (model order).

    The layers are cut into ``pp * vpp`` contiguous model chunks (virtual stages): ``parallel.chunk_layers``
    layers each, or ``num_layers / (pp * vpp)`` each (refused when that is not whole,
    :func:`layer_split_problem`). Chunk ``c`` runs on stage ``c mod pp`` (Megatron's interleaved
    assignment, ``megatron/core/pipeline_parallel/schedules.py``). The input embedding sits on stage 0 (with
    chunk 0), the LM head and loss on stage ``pp - 1`` (with the last chunk).
    """
    problem = layer_split_problem(num_layers, layout)
    if problem:
        raise ValueError(problem)
    chunks = layout.pp * layout.vpp
    sizes = layout.chunk_layers or (num_layers // chunks,) * chunks
    return np.repeat(np.arange(chunks) % layout.pp, sizes).astype(np.int64)
