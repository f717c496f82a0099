"""Checkpoint names of a physical MoE model: which logical expert each physical expert's weights are.

A trainer that runs ReLibra's physical MoE layers (``E + G * r`` dispatcher experts, docs/megatron.md)
still reads a logical checkpoint (``E`` experts per layer) and, in RL, pushes logical weights to its
rollout engine after every update (verl's ``export_weights`` / ``export_hf_weights``, slime's weight
sync). The weight converters of those trainers (mbridge, Megatron-Bridge) name a local expert row by a
global id, ``rank * experts_per_rank + row``. Built on a physical model, ``experts_per_rank`` is
``E / G + r``, so that id is the row's *physical id* (:class:`~relibra.megatron.physical.PhysicalExpertMap`:
rank ``g`` owns ``g * (E / G + r) ...``). This module maps such names back to logical experts:

* :func:`logical_expert` / :func:`logical_name`: physical id -> logical expert through the current
  placement (``phy2log [L, G, E / G]``, which moves with every plan); replica slots map to ``None``
  (their weights are copies, filled from the home rows, never a checkpoint's). On load it names the
  checkpoint weight a physical row reads; on export, the name a row's weight is sent under;
* :func:`to_logical`: a stream of ``(name, tensor)`` a converter exports from a physical model ->
  the logical stream, replica slots dropped, checked to hold every logical expert of every exported layer
  exactly once per weight (a missing or doubled expert raises, never a silently partial sync);
* :func:`strip_router_wrapper`: ReLibra's router wraps Megatron's (``router.logical.weight``); the
  converters know ``router.weight``.

The name format is a regular expression with ``layer`` and ``expert`` groups (:class:`ExpertNaming`);
:data:`HF_MLP_EXPERTS` (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4.5, OLMoE: ``model.layers.{l}.mlp.experts.{e}.``)
and :data:`HF_MIXTRAL_EXPERTS` (``model.layers.{l}.block_sparse_moe.experts.{e}.``) are given. Models with
dense layers before the MoE ones (DeepSeek's ``first_k_dense_replace``) pass ``moe_layers``: the
checkpoint layer index of each MoE layer, in order.

Wiring these into a converter is the trainer side's job (docs/integrations.md says what is done).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from relibra.megatron.physical import PhysicalExpertMap

__all__ = [
    "HF_MIXTRAL_EXPERTS",
    "HF_MLP_EXPERTS",
    "ExpertNaming",
    "ExpertSyncError",
    "logical_expert",
    "logical_name",
    "moe_index",
    "strip_router_wrapper",
    "to_logical",
]

T = TypeVar("T")


class ExpertSyncError(ValueError):
    """A physical model's export does not hold every logical expert exactly once."""


@dataclass(frozen=True)
class ExpertNaming:
    """A checkpoint's routed-expert parameter names: ``pattern`` matches a whole name with the groups
    ``layer`` (checkpoint layer index) and ``expert`` (expert index) and nothing else numbered."""

    pattern: str

    def __post_init__(self) -> None:
        groups = re.compile(self.pattern).groupindex
        if not {"layer", "expert"} <= set(groups):
            raise ValueError(f"ExpertNaming pattern {self.pattern!r} needs the groups 'layer' and 'expert'")

    def match(self, name: str) -> re.Match[str] | None:
        return re.fullmatch(self.pattern, name)

    def with_expert(self, m: re.Match[str], expert: int) -> str:
        """The matched name with its expert index replaced."""
        s, e = m.span("expert")
        return f"{m.string[:s]}{expert}{m.string[e:]}"


HF_MLP_EXPERTS = ExpertNaming(r"(?:.*\.)?layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\..+")
HF_MIXTRAL_EXPERTS = ExpertNaming(
    r"(?:.*\.)?layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)\..+"
)


def moe_index(layer: int, moe_layers: Sequence[int] | None, num_layers: int) -> int:
    """Index among the MoE layers of checkpoint layer ``layer`` (``moe_layers``: the checkpoint layer of
    each MoE layer, in order; None: every layer is one of ``num_layers`` MoE layers)."""
    if moe_layers is None:
        if not 0 <= layer < num_layers:
            raise ExpertSyncError(f"layer {layer}: the placement has MoE layers 0..{num_layers - 1}")
        return layer
    try:
        return list(moe_layers).index(layer)
    except ValueError:
        raise ExpertSyncError(f"layer {layer} holds routed experts but is not in moe_layers") from None


def logical_expert(
    expert_map: PhysicalExpertMap, phy2log: np.ndarray, moe_layer: int, physical: int
) -> int | None:
    """Logical expert in physical expert ``physical`` of MoE layer ``moe_layer``; ``None`` for a replica
    slot. phy2log int [L, G, E / G]."""
    if not 0 <= physical < expert_map.num_physical:
        raise ExpertSyncError(
            f"physical expert {physical}: the expert map has {expert_map.num_physical} "
            f"(E {expert_map.num_experts} + G {expert_map.num_gpus} x r {expert_map.replica_slots})"
        )
    gpu, row = divmod(physical, expert_map.slots_per_gpu)
    if row >= expert_map.experts_per_gpu:
        return None
    return int(phy2log[moe_layer, gpu, row])


def logical_name(
    name: str,
    expert_map: PhysicalExpertMap,
    phy2log: np.ndarray,
    naming: ExpertNaming = HF_MLP_EXPERTS,
    moe_layers: Sequence[int] | None = None,
) -> str | None:
    """A physical model's parameter name -> the logical checkpoint's: what a converter reads into that
    row on load and sends it as on export (``None``: a replica slot, not a checkpoint weight; the adapter
    fills it from the home rows). Names that are not routed experts come back unchanged."""
    m = naming.match(name)
    if m is None:
        return name
    moe_layer = moe_index(int(m["layer"]), moe_layers, phy2log.shape[0])
    expert = logical_expert(expert_map, phy2log, moe_layer, int(m["expert"]))
    return None if expert is None else naming.with_expert(m, expert)


def to_logical(
    weights: Iterable[tuple[str, T]],
    expert_map: PhysicalExpertMap,
    phy2log: np.ndarray,
    naming: ExpertNaming = HF_MLP_EXPERTS,
    moe_layers: Sequence[int] | None = None,
) -> Iterator[tuple[str, T]]:
    """Rename a physical model's exported ``(name, tensor)`` stream to logical names, dropping replica
    slots. At the end of the stream, every layer that exported a routed expert must have exported each of
    its ``E`` logical experts exactly once per weight kind (the name with the expert index blanked):
    :class:`ExpertSyncError` otherwise, naming the layer, the weight and the experts."""
    seen: dict[tuple[int, str], list[int]] = {}
    for name, tensor in weights:
        m = naming.match(name)
        if m is None:
            yield name, tensor
            continue
        moe_layer = moe_index(int(m["layer"]), moe_layers, phy2log.shape[0])
        expert = logical_expert(expert_map, phy2log, moe_layer, int(m["expert"]))
        if expert is None:
            continue
        seen.setdefault((int(m["layer"]), naming.with_expert(m, -1)), []).append(expert)
        yield naming.with_expert(m, expert), tensor
    for (layer, kind), experts in seen.items():
        got = np.bincount(np.asarray(experts), minlength=expert_map.num_experts)
        if (got != 1).any():
            missing = np.flatnonzero(got == 0).tolist()
            doubled = np.flatnonzero(got > 1).tolist()
            raise ExpertSyncError(
                f"layer {layer}, {kind.replace('.-1.', '.{e}.')}: logical experts missing {missing[:8]}"
                f"{' ...' if len(missing) > 8 else ''}, exported more than once {doubled[:8]}"
                f"{' ...' if len(doubled) > 8 else ''}; the placement (phy2log) is not the model's"
            )


def strip_router_wrapper(name: str) -> str:
    """``...mlp.router.logical.weight`` (ReLibra's :class:`~relibra.megatron.router.ReplicatingRouter`
    around Megatron's ``TopKRouter``) -> ``...mlp.router.weight``, the name converters map; other names
    unchanged."""
    return name.replace(".router.logical.", ".router.")
