"""Memory accounting of ReLibra's layer-shared replica buffer (the paper's overhead table).

Every GPU holds ``r`` replica slots of one expert's bf16 weights each. ReLibra's buffer is **layer-shared**:
it holds one layer's replicas at a time and is refilled (over NVLink, during that layer's attention) for
the next, so it costs ``r * expert_bytes`` per GPU whatever the depth. A per-layer buffer (what a static
redundant-expert scheme needs to keep every layer's extra copies resident) costs ``L * r * expert_bytes``.
The per-GPU parameter share the paper compares against depends on the parallel dimensions, so it is an input
(``ep``, ``tp``, ``pp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from relibra.cluster import ModelSpec

__all__ = [
    "PAPER_BUFFER_MIB",
    "PAPER_PARAM_FRACTION",
    "ReplicaBufferFootprint",
    "buffer_footprint",
    "per_gpu_parameter_bytes",
    "replica_buffer_bytes",
]

BF16_BYTES = 2
MIB = 1 << 20

PAPER_BUFFER_MIB = MappingProxyType(
    {"qwen3-30b-a3b": 18.0, "glm4.5-106b-a12b": 22.0, "qwen3-235b-a22b": 72.0}
)
"""Replica buffer per GPU reported by the paper (arXiv 2605.08639; :data:`analysis.paper.REPLICA_BUFFER`)."""
PAPER_PARAM_FRACTION = MappingProxyType(
    {"qwen3-30b-a3b": 0.0028, "glm4.5-106b-a12b": 0.0013, "qwen3-235b-a22b": 0.0162}
)
"""The same buffer as a fraction of the per-GPU parameters, as the paper reports it."""


def expert_weight_bytes(model: ModelSpec) -> int:
    """bf16 bytes of one expert (gate, up, down projections): one replica slot."""
    return model.expert_params * BF16_BYTES


def replica_buffer_bytes(model: ModelSpec, replica_slots: int) -> int:
    """Bytes per GPU of the layer-shared buffer, ``r * expert_bytes`` (column ``replica_buffer_bytes``)."""
    if replica_slots < 0:
        raise ValueError(f"replica_slots must be >= 0, got {replica_slots}")
    return replica_slots * expert_weight_bytes(model)


def per_gpu_parameter_bytes(model: ModelSpec, ep: int, tp: int = 1, pp: int = 1) -> float:
    """bf16 parameter bytes on one GPU: experts split over ``ep``, the rest over ``tp``, layers over ``pp``.

    Counts routed experts, attention projections, routers, shared experts, dense FFN layers, norms and the
    (untied) embedding and output layers.
    """
    if ep < 1 or tp < 1 or pp < 1:
        raise ValueError(f"ep={ep}, tp={tp}, pp={pp} must all be >= 1")
    m = model
    experts = m.num_moe_layers * m.num_experts * m.expert_params
    per_moe = m.hidden * m.num_experts + 3 * m.hidden * m.shared_ffn * m.shared_experts
    dense = (m.num_layers - m.num_moe_layers) * 3 * m.hidden * m.dense_ffn
    rest = m.num_layers * (m.attention_params + 2 * m.hidden) + m.num_moe_layers * per_moe + dense
    rest += 2 * m.vocab * m.hidden
    return BF16_BYTES * (experts / ep + rest / tp) / pp


@dataclass(frozen=True)
class ReplicaBufferFootprint:
    """Replica buffer of one model: layer-shared vs per-layer, against the per-GPU parameters."""

    model: str
    replica_slots: int
    num_moe_layers: int
    expert_bytes: int
    """bf16 bytes of one expert (one slot)."""
    layer_shared_bytes: int
    """``r * expert_bytes``: ReLibra's buffer per GPU."""
    per_layer_bytes: int
    """``L * r * expert_bytes``: a buffer with every layer's slots resident."""
    per_gpu_param_bytes: float
    """Parameter bytes per GPU under the given parallel dimensions."""

    @property
    def layer_shared_fraction(self) -> float:
        return self.layer_shared_bytes / self.per_gpu_param_bytes

    @property
    def per_layer_fraction(self) -> float:
        return self.per_layer_bytes / self.per_gpu_param_bytes

    @property
    def paper_mib(self) -> float | None:
        return PAPER_BUFFER_MIB.get(self.model)


def buffer_footprint(
    model: ModelSpec, replica_slots: int, ep: int, tp: int = 1, pp: int = 1
) -> ReplicaBufferFootprint:
    """The buffer accounting of ``model`` with ``r = replica_slots`` under the (ep, tp, pp) given."""
    shared = replica_buffer_bytes(model, replica_slots)
    return ReplicaBufferFootprint(
        model=model.name,
        replica_slots=replica_slots,
        num_moe_layers=model.num_moe_layers,
        expert_bytes=expert_weight_bytes(model),
        layer_shared_bytes=shared,
        per_layer_bytes=model.num_moe_layers * shared,
        per_gpu_param_bytes=per_gpu_parameter_bytes(model, ep, tp, pp),
    )
