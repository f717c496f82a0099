"""The router wrapper of the Megatron adapter: maps each routed (token, logical expert) to its home row or a
replica slot by the plan's integer split rule (:func:`relibra.executors.split.split_counts`)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from relibra.megatron.compat import megatron_api
from relibra.megatron.physical import PhysicalExpertMap

__all__ = ["ReplicatingRouter", "replicating_router"]


class ReplicatingRouter(nn.Module):
    """Megatron's logical ``TopKRouter`` followed by the logical -> physical relabelling of its routes.

    ``forward(hidden [S, B, H]) -> (probs [T, P], routing_map [T, P])`` over the ``P = E + G * r`` physical
    experts. Without a micro-batch table every expert's tokens go to its home row (``log2phy``); with one
    (:meth:`set_table`), each token goes to the copy the plan's split gives it.
    """

    def __init__(self, logical: nn.Module, expert_map: PhysicalExpertMap) -> None:
        super().__init__()
        self.logical: Any = logical
        self.expert_map = expert_map
        self.log2phy = torch.arange(expert_map.num_experts, dtype=torch.long)
        """long [E]: physical id of each expert's home row (set by the adapter)."""
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None
        """(phys [E, G], bound [E, G]) of :func:`slot_table` for the current micro-batch, or None."""

    @property
    def router_replay(self) -> Any:
        return getattr(self.logical, "router_replay", None)

    def set_layer_number(self, layer_number: int) -> None:
        self.logical.set_layer_number(layer_number)

    def set_table(self, table: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.table = None if table is None else tuple(torch.as_tensor(a, dtype=torch.long) for a in table)  # type: ignore[assignment]

    def forward(
        self, hidden: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, mask = self.logical(hidden, padding_mask)  # [T, E] each
        t, e_total = mask.shape
        if self.table is None:
            phys = self.log2phy.to(mask.device).expand(t, e_total)
        else:
            table, bound = (a.to(mask.device) for a in self.table)
            got = mask.sum(dim=0)
            if not torch.equal(got, bound[:, -1]):
                e = int(torch.nonzero(got != bound[:, -1])[0, 0])
                raise ValueError(
                    f"this rank routes {int(got[e])} tokens to expert {e} but the plan's load says "
                    f"{int(bound[e, -1])}; replay the routes the plan was made from "
                    "(RouterReplay REPLAY_FORWARD)"
                )
            rank_in_expert = mask.long().cumsum(dim=0) - 1  # [T, E]: position among e's tokens
            copy_idx = (rank_in_expert.unsqueeze(-1) >= bound.unsqueeze(0)).sum(dim=-1)  # [T, E]
            copy_idx = copy_idx.clamp_(max=bound.shape[1] - 1)
            phys = table.gather(1, copy_idx.T).T  # [T, E]
        routing_map = mask.new_zeros((t, self.expert_map.num_physical)).scatter(1, phys, mask)
        phys_probs = probs.new_zeros((t, self.expert_map.num_physical)).scatter(1, phys, probs)
        return phys_probs, routing_map


def replicating_router(expert_map: PhysicalExpertMap) -> Callable[..., ReplicatingRouter]:
    """A router builder for ``MoESubmodules(router=...)``: a logical ``TopKRouter`` over ``E`` experts
    (the layer's config copied with ``num_moe_experts = E``) wrapped in a :class:`ReplicatingRouter`.

    Takes the keywords the installed release's ``MoELayer`` passes (``is_mtp_layer`` from 0.19.2 on:
    :attr:`~relibra.megatron.compat.MegatronApi.router_builder_takes_is_mtp_layer`); refuses an
    unsupported release (:func:`~relibra.megatron.compat.megatron_api`) before any layer is built."""
    from megatron.core.transformer.moe.router import TopKRouter

    api = megatron_api()

    def build(*, config: Any, pg_collection: Any = None, is_mtp_layer: bool = False) -> ReplicatingRouter:
        if config.num_moe_experts != expert_map.num_physical:
            raise ValueError(
                f"the MoE layer's config has num_moe_experts={config.num_moe_experts}; a replicating layer "
                "needs "
                f"the physical count E + G * r = {expert_map.num_physical}"
            )
        logical = copy.deepcopy(config)
        logical.num_moe_experts = expert_map.num_experts
        mtp = {"is_mtp_layer": is_mtp_layer} if api.router_builder_takes_is_mtp_layer else {}
        return ReplicatingRouter(TopKRouter(config=logical, pg_collection=pg_collection, **mtp), expert_map)

    return build
