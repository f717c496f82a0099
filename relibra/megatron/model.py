"""A tiny Megatron-core MoE model for CPU runs: the test bed of the adapter and the RL-step example.

Each of the ``L`` layers is a dense mixing map (``h + tanh(h @ W^T)``, standing in for attention) followed
by a Megatron ``MoELayer`` (``TopKRouter`` with routing replay, ``alltoall`` dispatcher, ``SequentialMLP``
experts with a SwiGLU FFN, float32, no bias) and a residual: ``h <- a + moe(a)``.

Megatron's ``model_parallel_cuda_manual_seed`` needs CUDA; without it every EP rank would start its local
experts from the same random numbers. So experts are initialised per global expert id
(:func:`expert_weights`, the same self-identifying weights as ``relibra.executors.torch_moe.expert_init``),
and the router and mixing weights from seeds that every rank shares.

The expert's flat parameter order: ``fc1 [2F, H]`` (gate rows, then up rows) then ``fc2 [H, F]``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from relibra.executors.torch_moe import ExpertShape, expert_init
from relibra.megatron.adapter import MegatronPlanAdapter
from relibra.megatron.cpu_patches import apply_cpu_patches
from relibra.megatron.physical import PhysicalExpertMap
from relibra.megatron.router import replicating_router

__all__ = ["TinyMoEModel", "TinyMoESpec", "expert_weights", "init_expert_parallel", "moe_config"]


@dataclass(frozen=True)
class TinyMoESpec:
    """Shape of the tiny model."""

    num_layers: int
    hidden: int
    ffn: int
    """Expert FFN width (``moe_ffn_hidden_size``)."""
    num_experts: int
    top_k: int
    seed: int = 0

    @property
    def expert_shape(self) -> ExpertShape:
        return ExpertShape(self.hidden, self.ffn)


def init_expert_parallel(ep_size: int) -> None:
    """Apply the CPU patches and Megatron's parallel state with EP = ``ep_size`` (torch.distributed is up)."""
    from megatron.core import parallel_state

    apply_cpu_patches()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=ep_size)


def moe_config(spec: TinyMoESpec, num_moe_experts: int, ep_size: int) -> Any:
    """The ``TransformerConfig`` of one MoE layer with ``num_moe_experts`` dispatcher experts."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=spec.hidden,
        num_attention_heads=1,
        ffn_hidden_size=spec.ffn,
        moe_ffn_hidden_size=spec.ffn,
        num_moe_experts=num_moe_experts,
        moe_router_topk=spec.top_k,
        moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=True,
        moe_router_fusion=False,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        expert_model_parallel_size=ep_size,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )


def expert_weights(spec: TinyMoESpec, layer: int, expert: int) -> torch.Tensor:
    """Flat weights [3 * H * F] of logical expert ``(layer, expert)``: a function of the ids only."""
    return expert_init(layer, expert, spec.expert_shape, spec.seed)


def _build_moe_layer(config: Any, expert_map: PhysicalExpertMap | None) -> nn.Module:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    experts = ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    if expert_map is None:
        return MoELayer(config, MoESubmodules(experts=experts))
    return MoELayer(config, MoESubmodules(experts=experts, router=replicating_router(expert_map)))


class TinyMoEModel(nn.Module):
    """``L`` x (mixing map, Megatron ``MoELayer``) on this rank; ``forward(h [T, H]) -> [T, H]``.

    ``replica_slots=None`` builds the plain Megatron layers (``E`` dispatcher experts, static placement);
    an integer ``r`` builds ReLibra's physical layers (``E + G * r``) and attaches a
    :class:`~relibra.megatron.adapter.MegatronPlanAdapter` as :attr:`adapter`. Clears Megatron's global
    ``RouterReplay`` list first, so the global replay calls address this model's routers.
    """

    def __init__(self, spec: TinyMoESpec, ep_size: int, replica_slots: int | None = None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        super().__init__()
        self.spec = spec
        RouterReplay.clear_global_router_replay_instances()
        self.expert_map = (
            None if replica_slots is None else PhysicalExpertMap(spec.num_experts, ep_size, replica_slots)
        )
        num = spec.num_experts if self.expert_map is None else self.expert_map.num_physical
        config = moe_config(spec, num, ep_size)
        self.moe: Any = nn.ModuleList(
            [_build_moe_layer(config, self.expert_map) for _ in range(spec.num_layers)]
        )
        gen = torch.Generator().manual_seed(spec.seed * 7_919 + 1)
        h = spec.hidden
        self.mix = nn.Parameter(torch.randn(spec.num_layers, h, h, generator=gen) / h)
        with torch.no_grad():
            for router in self.routers:
                router.weight.copy_(torch.randn(spec.num_experts, h, generator=gen) / h**0.5)
        self.adapter: MegatronPlanAdapter | None = None
        if self.expert_map is None:
            rank, per_gpu = torch.distributed.get_rank(), spec.num_experts // ep_size
            layers: list[Any] = list(self.moe)
            for layer, module in enumerate(layers):
                with torch.no_grad():
                    for i, mlp in enumerate(module.experts.local_experts):
                        flat = expert_weights(spec, layer, rank * per_gpu + i)
                        fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
                        fc1.copy_(flat[: fc1.numel()].view_as(fc1))
                        fc2.copy_(flat[fc1.numel() :].view_as(fc2))
        else:
            self.adapter = MegatronPlanAdapter(list(self.moe), self.expert_map)
            for layer in range(spec.num_layers):
                self.adapter.load_expert_weights(layer, functools.partial(expert_weights, spec, layer))

    @property
    def routers(self) -> list[Any]:
        """The logical ``TopKRouter`` of every layer (the one holding ``router_replay``), in layer order."""
        return [getattr(m.router, "logical", m.router) for m in self.moe]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Every parameter except the replica slots (views of the replica buffer): the optimizer's."""
        skip = set() if self.adapter is None else {id(p) for p in self.adapter.replica_parameters()}
        return [p for p in self.parameters() if id(p) not in skip]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer, moe in enumerate(self.moe):
            a = h + torch.tanh(h @ self.mix[layer].T)
            out, _ = moe(a.unsqueeze(1))  # Megatron's [S, B, H] with B = 1: token order is kept
            h = a + out.squeeze(1)
        return h

    def expert_state(self, layer: int) -> dict[int, np.ndarray]:
        """Logical id -> flat weights of this rank's home experts of ``layer`` (plain or physical)."""
        if self.adapter is not None:
            return {e: w.numpy().copy() for e, w in self.adapter.expert_weights(layer).items()}
        return {e: _flat(m, grad=False) for e, m in self._plain_rows(layer)}

    def expert_grad_state(self, layer: int) -> dict[int, np.ndarray]:
        """Logical id -> flat weight gradients of this rank's home experts of ``layer``."""
        if self.adapter is not None:
            return {e: g.numpy().copy() for e, g in self.adapter.expert_grads(layer).items()}
        return {e: _flat(m, grad=True) for e, m in self._plain_rows(layer)}

    def _plain_rows(self, layer: int) -> list[tuple[int, Any]]:
        rank, rows = torch.distributed.get_rank(), self.moe[layer].experts.local_experts
        return [(rank * len(rows) + i, m) for i, m in enumerate(rows)]


def _flat(mlp: Any, grad: bool) -> np.ndarray:
    params = (mlp.linear_fc1.weight, mlp.linear_fc2.weight)
    parts = [(p.grad if grad else p).detach().reshape(-1) for p in params]  # type: ignore[union-attr]
    return torch.cat(parts).numpy().copy()
