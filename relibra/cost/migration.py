"""What a re-homed expert carries across the fabric when reordering moves it (DESIGN.md, "Cost model").

Reordering happens between two optimizer steps (one RL training step per batch), so a moved expert carries
its weights and its optimizer state and no gradient (gradients are zero between steps). Under Megatron-LM's
mixed precision with Adam (``--bf16``, the default ``--use-precision-aware-optimizer=False``) that is, per
parameter: the bf16 weight (2 bytes), the fp32 master weight (4) and Adam's two fp32 moments
``exp_avg`` and ``exp_avg_sq`` (8), 14 bytes in all.

With a distributed optimizer (``--use-distributed-optimizer``) the master weights and the moments of the
expert parameters are sharded over the expert-data-parallel group, so each EP group moves its weights and
``1 / optimizer_shards`` of the optimizer state. This dataclass holds the one default of every field; the
Hydra keys ``simulator.migration.*`` override them (``null`` keeps the default here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BYTES_PER_PARAM", "MigrationPayload", "migration_payload"]


@dataclass(frozen=True)
class MigrationPayload:
    """Bytes per parameter a re-homed expert carries, by part."""

    weight_bytes: float = 2.0
    """The model copy of the weight (bf16: 2; fp8 weights: 1)."""
    master_weight_bytes: float = 4.0
    """The optimizer's master weight (fp32: 4; 0 without a separate master copy)."""
    optimizer_state_bytes: float = 8.0
    """Optimizer state per parameter (Adam's two fp32 moments: 8; bf16 moments: 4)."""
    optimizer_shards: int = 1
    """Ranks of the expert-data-parallel group the master weights and optimizer state are sharded over
    (a distributed optimizer); 1: every EP group holds the whole state of its experts."""

    def __post_init__(self) -> None:
        for key in ("weight_bytes", "master_weight_bytes", "optimizer_state_bytes"):
            value = getattr(self, key)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and math.isfinite(value) and value >= 0):
                raise ValueError(f"simulator.migration.{key}={value}: expected a finite number >= 0")
        shards = self.optimizer_shards
        if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
            raise ValueError(
                f"simulator.migration.optimizer_shards={self.optimizer_shards}: expected an integer >= 1 "
                "(the expert-data-parallel ranks the optimizer state is sharded over)"
            )

    @property
    def bytes_per_param(self) -> float:
        """Bytes one EP group moves per parameter of a re-homed expert."""
        state = self.master_weight_bytes + self.optimizer_state_bytes
        return self.weight_bytes + state / self.optimizer_shards


def migration_payload(overrides: Mapping[str, Any] | None = None) -> MigrationPayload:
    """The payload with ``overrides`` (e.g. the ``simulator.migration`` config node) applied; a ``None``
    value keeps the field's default."""
    given = {k: v for k, v in dict(overrides or {}).items() if v is not None}
    unknown = sorted(set(given) - set(MigrationPayload.__dataclass_fields__))
    if unknown:
        raise ValueError(
            f"simulator.migration: unknown keys {unknown}; expected weight_bytes, master_weight_bytes, "
            "optimizer_state_bytes, optimizer_shards"
        )
    return MigrationPayload(**given)


DEFAULT_BYTES_PER_PARAM = MigrationPayload().bytes_per_param
"""14.0: bf16 weight, fp32 master weight, two fp32 Adam moments; no gradient, no optimizer sharding."""
