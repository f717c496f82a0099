"""The executor seam: something that runs a sequence of batch plans and reports per-layer times."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.types import BatchPlan


@dataclass(frozen=True)
class ExecutionReport:
    """Times reported by an executor for the plans it ran."""

    moe_time_s: np.ndarray
    """float64 [M, L]: seconds of the MoE part of each (micro-batch, layer), measured or simulated."""
    extra: dict[str, float] = field(default_factory=dict)


class Executor(Protocol):
    name: str

    def execute(
        self, plans: Sequence[BatchPlan], model: ModelSpec, cluster: ClusterSpec
    ) -> ExecutionReport: ...
