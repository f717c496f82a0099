"""mbridge's checkpoint conversion for ReLibra's physical MoE model: load a logical Hugging Face checkpoint
into the home rows of the current placement, export the logical model whatever the plans moved.

mbridge (``pip install mbridge``; verl's Megatron workers call its ``load_weights`` and
``export_weights``) names a rank's local expert rows ``rank * (num_moe_experts / EP) + row``
(``mbridge/core/bridge.py``: ``_weight_name_mapping_mcore_local_to_global`` on load, the EP branch of
``export_weights``). ReLibra's physical layers hold ``E / G + r`` rows per rank, the first ``E / G`` the
home rows of the current placement and the last ``r`` replica slots (docs/megatron.md), so neither name is
the logical expert. :func:`physical_bridge` returns the bridge with two methods of its class overridden,
everything else mbridge's own:

* ``_weight_name_mapping_mcore_local_to_global(model, consider_ep=True)`` (load): a home row is named by
  the logical expert the placement puts there (``phy2log [L, G, E / G]``, read when the call is made, so a
  resume after placement moves reads the right rows); replica slots are left out (they hold copies, which
  :class:`~relibra.megatron.adapter.MegatronPlanAdapter` fills from the home rows before each
  micro-batch, never checkpoint weights). ``consider_ep=False`` (export's call) names each row by its
  local index, which mbridge's export turns into the physical id, since the bridge's config counts
  ``E + G * r`` experts;
* ``export_weights(models)``: mbridge's stream renamed to logical experts through the placement at the
  start of the export, replica slots dropped, every logical expert of every layer checked to be there
  exactly once (:func:`relibra.integrations.expert_names.to_logical`, which raises
  :class:`~relibra.integrations.expert_names.ExpertSyncError` otherwise): the weights a trainer pushes to
  its rollout engine are the logical model's.

Both ways of holding the experts map to mbridge's grouped names: ``...mlp.experts.linear_fc1.weight{row}``
(TE's grouped GEMM, what mbridge's model provider builds) and
``...mlp.experts.local_experts.{row}.linear_fc1.weight`` (Megatron's ``SequentialMLP``, what the adapter
runs on CPU). ReLibra's router wrapper's parameters (``router.logical.weight``) are named as Megatron's
router's.

The copy also builds the physical model: its config counts ``E + G * r`` experts with
``moe_grouped_gemm`` off (the adapter's replica slots are rows of their own, ``SequentialMLP``), and its
``_get_transformer_layer_spec`` is mbridge's spec with every MoE layer's router replaced by
:func:`relibra.megatron.router.replicating_router` (:func:`replicating_layer_spec`). So mbridge's
``get_model`` (what verl's Megatron workers call to build the actor, before the DDP wrap) returns MoE
layers that :class:`~relibra.megatron.adapter.MegatronPlanAdapter` takes as they are. Not supported: expert
tensor parallelism (``etp_size > 1``) and pipeline stages that split the MoE layers (``moe_layers`` maps
checkpoint layers, not stages).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from relibra.integrations.expert_names import (
    HF_MLP_EXPERTS,
    ExpertNaming,
    ExpertSyncError,
    moe_index,
    strip_router_wrapper,
    to_logical,
)
from relibra.megatron.adapter import MegatronPlanAdapter
from relibra.megatron.physical import PhysicalExpertMap

__all__ = [
    "PhysicalExpertNames",
    "global_expert_names",
    "physical_adapter",
    "physical_bridge",
    "replicating_layer_spec",
]

_SEQUENTIAL = re.compile(
    r"(?P<prefix>.*decoder\.layers\.(?P<layer>\d+)\.mlp\.experts)\.local_experts\.(?P<row>\d+)\."
    r"(?P<part>linear_fc[12])\.weight"
)
_GROUPED = re.compile(
    r"(?P<prefix>.*decoder\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<part>linear_fc[12])\.weight(?P<row>\d+)"
)


def global_expert_names(
    names: Mapping[str, str],
    expert_map: PhysicalExpertMap,
    phy2log: np.ndarray,
    ep_rank: int,
    *,
    load: bool,
    moe_layers: Sequence[int] | None = None,
) -> dict[str, str]:
    """mbridge's local -> global name map without its EP step (``names``) -> the physical model's.

    ``load=True``: each home row of rank ``ep_rank`` -> mbridge's grouped name of its logical expert
    (``phy2log [L, G, E / G]``), replica slots left out. ``load=False``: each row -> the grouped name of its
    local row index (mbridge's export adds ``ep_rank * (E / G + r)``). Router wrapper names -> Megatron's
    router names; other names unchanged."""
    if not 0 <= ep_rank < expert_map.num_gpus:
        raise ExpertSyncError(f"ep_rank {ep_rank}: the expert map has {expert_map.num_gpus} EP ranks")
    out: dict[str, str] = {}
    for local, name in names.items():
        m = _SEQUENTIAL.fullmatch(name) or _GROUPED.fullmatch(name)
        if m is None:
            out[local] = strip_router_wrapper(name)
            continue
        row = int(m["row"])
        if row >= expert_map.slots_per_gpu:
            raise ExpertSyncError(
                f"{local}: local expert row {row}, but a rank of the physical model holds "
                f"{expert_map.slots_per_gpu} (E / G {expert_map.experts_per_gpu} + r "
                f"{expert_map.replica_slots}); is the model built with num_moe_experts = E + G * r?"
            )
        if not load:
            out[local] = f"{m['prefix']}.{m['part']}.weight{row}"
            continue
        if row >= expert_map.experts_per_gpu:
            continue  # a replica slot: filled from the home rows, not read from the checkpoint
        moe = moe_index(int(m["layer"]), moe_layers, phy2log.shape[0])
        out[local] = f"{m['prefix']}.{m['part']}.weight{int(phy2log[moe, ep_rank, row])}"
    return out


def replicating_layer_spec(spec: Any, expert_map: PhysicalExpertMap) -> Any:
    """A copy of a Megatron decoder block spec (``TransformerBlockSubmodules``, as
    ``get_gpt_decoder_block_spec`` returns) or of one layer's ``ModuleSpec`` in which every MoE layer's
    router is :func:`~relibra.megatron.router.replicating_router` of ``expert_map``; ``spec`` is left as it
    was.

    Refuses a spec with no MoE layer (nothing to replicate) and one whose MoE experts are not per-row
    modules (``moe_grouped_gemm``: the adapter binds each replica slot to a row of its own)."""
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from relibra.megatron.router import replicating_router

    out = copy.deepcopy(spec)
    layers = out.layer_specs if isinstance(out, TransformerBlockSubmodules) else [out]
    moe = 0
    for i, layer in enumerate(layers):
        mlp = layer.submodules.mlp
        if not isinstance(mlp.submodules, MoESubmodules):
            continue
        experts = mlp.submodules.experts
        kind = experts.module if isinstance(experts, ModuleSpec) else experts
        if kind is not SequentialMLP:
            raise ExpertSyncError(
                f"layer spec {i}: MoE experts are {getattr(kind, '__name__', kind)}, not SequentialMLP; "
                "build the physical model with moe_grouped_gemm=False"
            )
        mlp.submodules.router = replicating_router(expert_map)
        moe += 1
    if moe == 0:
        raise ExpertSyncError("the layer spec has no MoE layer: nothing for the replicating router to wrap")
    return out


class PhysicalExpertNames:
    """Mixin over an mbridge ``Bridge`` class (placed first in the bases): the physical model's expert names
    on load and export (module doc). Set up by :func:`physical_bridge`."""

    relibra_expert_map: PhysicalExpertMap
    relibra_phy2log: Callable[[], np.ndarray]
    relibra_moe_layers: tuple[int, ...] | None
    relibra_naming: ExpertNaming
    mpu: Any

    def _weight_name_mapping_mcore_local_to_global(
        self, model: Any, consider_ep: bool = True
    ) -> dict[str, str]:
        names = super()._weight_name_mapping_mcore_local_to_global(model, consider_ep=False)  # type: ignore[misc]
        return global_expert_names(
            names, self.relibra_expert_map, self.relibra_phy2log(), int(self.mpu.ep_rank), load=consider_ep,
            moe_layers=self.relibra_moe_layers,
        )  # fmt: skip

    def _get_transformer_layer_spec(self, vp_stage: int | None = None) -> Any:
        spec = super()._get_transformer_layer_spec(vp_stage)  # type: ignore[misc]
        return replicating_layer_spec(spec, self.relibra_expert_map)

    def export_weights(self, models: list[Any]) -> Iterator[tuple[str, Any]]:
        phy2log = np.array(self.relibra_phy2log(), copy=True)  # the placement as the export starts
        stream = super().export_weights(models)  # type: ignore[misc]
        expert_map, naming, moe_layers = self.relibra_expert_map, self.relibra_naming, self.relibra_moe_layers
        yield from to_logical(stream, expert_map, phy2log, naming, moe_layers)


def physical_bridge(
    bridge: Any,
    expert_map: PhysicalExpertMap,
    phy2log: np.ndarray | Callable[[], np.ndarray],
    moe_layers: Sequence[int] | None = None,
    naming: ExpertNaming = HF_MLP_EXPERTS,
) -> Any:
    """A copy of mbridge ``bridge`` (built from the logical Hugging Face config) that loads and exports the
    physical model of ``expert_map`` (module doc); ``bridge`` itself is left as it was.

    ``phy2log``: the placement, ``int [L, G, E / G]``, or a function returning the current one (e.g.
    ``lambda: adapter.phy2log``, so that load and export follow every plan). ``moe_layers``: the
    checkpoint layer of each MoE layer, in order, when dense layers come first. ``naming``: the
    checkpoint's expert names (:data:`~relibra.integrations.expert_names.HF_MIXTRAL_EXPERTS` for Mixtral).
    The copy's config counts ``E + G * r`` experts without grouped GEMM, and its layer spec has the
    replicating router, so ``get_model`` builds the physical model (module doc)."""
    config, mpu = bridge.config, bridge.mpu
    if int(config.num_moe_experts) != expert_map.num_experts:
        raise ExpertSyncError(
            f"bridge config num_moe_experts={config.num_moe_experts}, but the expert map has "
            f"E={expert_map.num_experts} logical experts; build the bridge from the logical checkpoint's "
            "config"
        )
    if int(mpu.ep_size) != expert_map.num_gpus:
        raise ExpertSyncError(
            f"bridge ep_size={mpu.ep_size}, but the expert map has G={expert_map.num_gpus} EP ranks"
        )
    if int(mpu.etp_size) != 1:
        raise ExpertSyncError(f"bridge etp_size={mpu.etp_size}: expert tensor parallelism is not supported")
    base = type(bridge)
    cls: Any = type(f"Physical{base.__name__}", (PhysicalExpertNames, base), {})
    out = cls.__new__(cls)
    out.__dict__.update(bridge.__dict__)  # a shallow copy of the bridge's state, under the new class
    out.config = copy.copy(config)
    out.config.num_moe_experts = expert_map.num_physical
    out.config.moe_grouped_gemm = False
    out.relibra_expert_map = expert_map
    out.relibra_phy2log = phy2log if callable(phy2log) else (lambda: phy2log)
    out.relibra_moe_layers = None if moe_layers is None else tuple(int(x) for x in moe_layers)
    out.relibra_naming = naming
    return out


def physical_adapter(models: Sequence[Any], expert_map: PhysicalExpertMap) -> MegatronPlanAdapter:
    """The :class:`~relibra.megatron.adapter.MegatronPlanAdapter` over the MoE layers of the model chunks
    ``models`` that a :func:`physical_bridge`'s ``get_model`` built (or its model provider), wrapped or not
    (Megatron's DDP, FSDP and ``Float16Module`` are unwrapped), in layer order across the chunks.

    Every rank of the EP group calls it at the same time (the adapter's first router sync is a
    collective). Refuses chunks without MoE layers and layers that are not the physical model's (the
    adapter's own checks: the replicating router, ``E / G + r`` rows)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.utils import unwrap_model

    layers = [
        layer.mlp
        for chunk in unwrap_model(list(models))
        for layer in chunk.decoder.layers
        if isinstance(layer.mlp, MoELayer)
    ]
    if not layers:
        raise ExpertSyncError("the model chunks hold no MoE layer (decoder.layers[*].mlp)")
    return MegatronPlanAdapter(layers, expert_map)
