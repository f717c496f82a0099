"""What happened while one batch was planned: per-layer fallbacks, the locality round's fate, timings.

Timing (seconds, in :class:`PlanReport` and ``BatchPlan.stats``): measured from the last sample's
arrival (the last ``ControlPlane.submit`` before ``seal``): ``time_to_first_plan_s`` (one layer fully
planned), ``time_to_all_plans_s`` (every layer planned or failed), ``plan_cpu_s`` (sum of task times in
workers). ``BatchPlan.plan_time_s`` is ``time_to_all_plans_s`` (or the delivery time when the deadline
cut planning short).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntFlag, StrEnum

import numpy as np

__all__ = ["Fallback", "LocalityStatus", "PlanReport"]


class Fallback(IntFlag):
    """Per-layer fallback flags of a delivered plan (0: fully planned)."""

    NONE = 0
    PREVIOUS_PLACEMENT = 1
    """Reordering not ready or failed: the layer keeps the previous batch's placement."""
    NO_REPLICATION = 2
    """Replication not ready or failed: every expert of the layer is computed at home."""


class LocalityStatus(StrEnum):
    """What became of a batch's locality round (the sample re-assignment after placement)."""

    OFF = "off"
    """The reorderer has no locality round: samples stay on their input GPUs by design."""
    DONE = "done"
    """The round ran: samples are on the GPUs it chose, loads regrouped accordingly."""
    TIMED_OUT = "timed_out"
    """Fallback: the round ran past ``locality_deadline_s``; samples keep their input GPUs."""
    FAILED = "failed"
    """Fallback: the round raised, or its worker died ``max_retries + 1`` times; input GPUs kept."""
    NOT_READY = "not_ready"
    """Fallback: :meth:`ControlPlane.plans`'s deadline came first; input GPUs kept."""


@dataclass(frozen=True)
class PlanReport:
    """What happened while one batch was planned."""

    batch: int
    fallback: np.ndarray
    """int8 [L]: :class:`Fallback` flags of each layer in the delivered plan."""
    layer_ready_s: np.ndarray
    """float64 [L]: seconds from the last arrival until the layer was fully planned (NaN: it was not)."""
    time_to_first_plan_s: float
    """Seconds from the last arrival until the first layer was fully planned (NaN: none was)."""
    time_to_all_plans_s: float
    """Seconds from the last arrival until every layer was planned or failed (NaN: cut by the deadline)."""
    assemble_s: float
    """Seconds spent on workload assembly."""
    plan_cpu_s: float
    """Sum of the finished tasks' run times in the workers."""
    wait_s: float
    """Seconds :meth:`ControlPlane.plans` blocked the trainer."""
    retries: int
    """Tasks re-run after their worker died."""
    worker_crashes: int
    """Worker processes that died while running one of this batch's tasks."""
    errors: tuple[str, ...] = ()
    """One line per failed task: ``layer L reorder: ...`` (``batch locality: ...`` for the locality round)."""
    locality: LocalityStatus = LocalityStatus.OFF
    """What became of the locality round (its fallback: every sample on its input GPU)."""
    locality_s: float = math.nan
    """Seconds the locality round ran in its worker (NaN: it did not finish)."""

    @property
    def locality_fallback(self) -> bool:
        """The plan keeps the input sample assignment although a locality round was due."""
        return self.locality in (LocalityStatus.TIMED_OUT, LocalityStatus.FAILED, LocalityStatus.NOT_READY)

    @property
    def previous_placement_layers(self) -> int:
        return int(np.count_nonzero(self.fallback & Fallback.PREVIOUS_PLACEMENT))

    @property
    def no_replication_layers(self) -> int:
        return int(np.count_nonzero(self.fallback & Fallback.NO_REPLICATION))
