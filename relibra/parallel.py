"""The parallel layout around the EP group, as far as the harness needs it today (glossary: parallel layout).

``cluster.nodes x cluster.gpus_per_node`` is one EP group, the GPUs every planner balances. ``parallel.dp``
(default 1) is the number of data-parallel replicas of that group: the run trains on ``dp * G`` GPUs, each
replica on its own share of the batch, every replica holding the same experts in the same places.

Megatron-core derives the expert-data-parallel size as ``world_size / (expert_tensor_parallel_size *
expert_model_parallel_size * pipeline_model_parallel_size)`` (``megatron/core/parallel_state.py:
initialize_model_parallel``, the expert mesh ``ETP x EP x EDP x PP``). With no tensor or pipeline
parallelism around the EP group (what the harness simulates), ``world_size = dp * EP`` and the
expert-data-parallel size is ``dp``: the ranks that hold the same experts, over which the distributed
optimizer shards their master weights and moments (:mod:`relibra.cost.migration`). The full layout
(``parallel.tp``, ``parallel.pp``, ``parallel.vpp``) extends :class:`ParallelLayout` and
:func:`expert_data_parallel`; nothing else reads the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelLayout", "expert_data_parallel"]


@dataclass(frozen=True)
class ParallelLayout:
    """The ``parallel.*`` keys; every default here is the one default."""

    dp: int = 1
    """Data-parallel replicas of the EP group (``parallel.dp``)."""

    def __post_init__(self) -> None:
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(
                f"parallel.dp={self.dp}: expected an integer >= 1 (data-parallel replicas of the EP group)"
            )

    def world_size(self, ep: int) -> int:
        """GPUs the run trains on for an EP group of ``ep`` GPUs."""
        return self.dp * ep


def expert_data_parallel(layout: ParallelLayout, ep: int) -> int:
    """Megatron's expert-data-parallel size ``world / (ETP * EP * PP)`` with ``ETP = PP = 1``: ``dp``."""
    etp = pp = 1
    return layout.world_size(ep) // (etp * ep * pp)
