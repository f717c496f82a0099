"""Run ReLibra plans inside megatron-core's ``MoELayer``: placement, replication, replica gradients.

Glossary (DESIGN.md, plus EPLB's words for the physical side):

* **logical expert** ``e`` in ``[0, E)``: the id the router picks and the trace stores;
* **physical expert**: a slot of Megatron's dispatcher. Every rank ``g`` of the EP group owns
  ``E / G + r`` contiguous physical experts (the alltoall dispatcher needs each rank's local experts
  contiguous): first its ``E / G`` **home rows**, then its ``r`` **replica slots**, so the dispatcher sees
  ``E + G * r`` physical experts. Physical id of home row ``i`` of rank ``g``: ``g * (E / G + r) + i``;
  of replica slot ``s``: ``g * (E / G + r) + E / G + s``.
* ``phy2log [L, G, E / G]``: the logical expert in each home row (EPLB's ``phy2log``, home rows only);
  ``log2phy [L, E]``: the physical id of each expert's home row.

Worked example: ``E = 8``, ``G = 4``, ``r = 1``: 12 physical experts, rank 1 owns physical ids 3, 4 (home
rows) and 5 (its replica slot). Under Megatron's static placement ``phy2log[l, 1] = [2, 3]`` and
``log2phy[l, 2] = 3``. If the plan of a micro-batch puts a replica of expert 6 in rank 1's slot, tokens that
the plan sends to that copy are routed to physical expert 5.

What the adapter does to a model built with :func:`replicating_router` routers and ``E / G + r`` local
``SequentialMLP`` experts per rank:

1. **placement** (:meth:`MegatronPlanAdapter.apply_placement`, once per batch): relabel logical to
   physical experts and move each expert that changes home, with its weights, gradients and optimizer
   state, to a freed home row of its new rank (unmoved experts keep their rows; freed rows ascending take
   incoming experts ascending, as ``relibra.executors.reorder_ops``);
2. **replication** (:meth:`MegatronPlanAdapter.set_microbatch`, per micro-batch): the replica slots of
   every layer are views of one **layer-shared replica buffer** (``r`` experts per rank). A forward
   pre-hook of layer ``l`` fills the buffer with that (micro-batch, layer)'s replicas from their home ranks;
   an autograd hook at the layer's output refills it in backward, before the layer's expert backward
   reads the weights again;
3. **token split**: the router wrapper maps each routed (token, expert) to the home row or a replica slot
   by the integer proportional split rule (``relibra.executors.torch_moe.split_counts``): source rank
   ``j`` sends ``split[j, e, g]`` of its tokens for ``e`` to the copy on rank ``g``, in token order, copies
   by ascending rank;
4. **replica gradients**: an autograd hook at the layer's input, reached after the layer's expert
   backward, sends every replica slot's weight gradient to the home rank and adds it into the home
   expert's gradient (``relibra.executors.replica_buffer.reduce_slot_grads``).

Outputs and gradients equal those of the plain layer with the same routes (up to float summation order).

Limits: the EP group must be the whole default process group (ranks are GPUs); permanent redundant slots
(EPLB+, LPLB+) and activation recomputation of the MoE layer are not supported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from relibra.executors.reorder_ops import param_state_tensors
from relibra.executors.replica_buffer import ReplicaBuffer, SlotCopies, fill_slots, reduce_slot_grads
from relibra.executors.torch_moe import split_counts
from relibra.types import BatchPlan

__all__ = [
    "MegatronPlanAdapter",
    "PhysicalLayout",
    "ReplicatingRouter",
    "log2phy",
    "next_phy2log",
    "replicating_router",
    "slot_table",
]

REDUCE_TAG_BASE = 1 << 13
"""P2P tags of replica-gradient reduction start here (fills use the slot index)."""
MOVE_TAG_BASE = 1 << 14
"""P2P tags of placement moves start here."""


@dataclass(frozen=True)
class PhysicalLayout:
    """How ``E`` logical experts, ``G`` ranks and ``r`` replica slots map onto Megatron's physical experts."""

    num_experts: int
    num_gpus: int
    replica_slots: int

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_experts % self.num_gpus:
            raise ValueError(
                f"num_experts={self.num_experts} must be a multiple of num_gpus={self.num_gpus} (>= 1)"
            )
        if self.replica_slots < 0:
            raise ValueError(f"replica_slots={self.replica_slots}; expected >= 0")

    @property
    def experts_per_gpu(self) -> int:
        """Home rows per rank (``E / G``)."""
        return self.num_experts // self.num_gpus

    @property
    def slots_per_gpu(self) -> int:
        """Physical experts per rank (``E / G + r``)."""
        return self.experts_per_gpu + self.replica_slots

    @property
    def num_physical(self) -> int:
        """Physical experts Megatron's dispatcher sees (``E + G * r``)."""
        return self.num_gpus * self.slots_per_gpu

    def home_id(self, gpu: np.ndarray | int, row: np.ndarray | int) -> np.ndarray | int:
        return gpu * self.slots_per_gpu + row

    def replica_id(self, gpu: np.ndarray | int, slot: np.ndarray | int) -> np.ndarray | int:
        return gpu * self.slots_per_gpu + self.experts_per_gpu + slot

    def static_phy2log(self, num_layers: int) -> np.ndarray:
        """Megatron's contiguous placement: int64 [L, G, E / G] with ``phy2log[l, g, i] = g * E / G + i``."""
        per_gpu = np.arange(self.num_experts, dtype=np.int64).reshape(self.num_gpus, self.experts_per_gpu)
        return np.broadcast_to(per_gpu, (num_layers, *per_gpu.shape)).copy()


def log2phy(layout: PhysicalLayout, phy2log: np.ndarray) -> np.ndarray:
    """phy2log [L, G, E / G] -> int64 [L, E]: physical id of each expert's home row."""
    num_layers, g, n = phy2log.shape
    out = np.empty((num_layers, layout.num_experts), dtype=np.int64)
    ids = np.asarray(layout.home_id(np.arange(g)[:, None], np.arange(n)[None, :]))  # [G, n]
    np.put_along_axis(
        out, phy2log.reshape(num_layers, -1), np.broadcast_to(ids.reshape(-1), (num_layers, g * n)), 1
    )
    return out


def next_phy2log(phy2log: np.ndarray, new_home: np.ndarray) -> np.ndarray:
    """Home rows after moving to placement new_home [L, E]: unmoved experts keep their rows, freed rows
    (ascending) take the incoming experts (ascending). phy2log [L, G, n] -> int64 [L, G, n]."""
    num_layers, g, n = phy2log.shape
    counts = np.stack([(new_home == gpu).sum(axis=1) for gpu in range(g)], axis=1)  # [L, G]
    if (counts != n).any():
        layer, gpu = np.argwhere(counts != n)[0]
        raise ValueError(
            f"new home: layer {layer} puts {counts[layer, gpu]} experts on rank {gpu}; expected E / G = {n}"
        )
    out = np.array(phy2log, dtype=np.int64, copy=True)
    for layer in range(num_layers):
        for gpu in range(g):
            stays = new_home[layer, out[layer, gpu]] == gpu  # [n]
            incoming = np.setdiff1d(np.flatnonzero(new_home[layer] == gpu), out[layer, gpu][stays])
            out[layer, gpu, np.flatnonzero(~stays)] = incoming
    return out


def slot_table(
    layout: PhysicalLayout,
    home_phys: np.ndarray,
    home: np.ndarray,
    replicas: np.ndarray | None,
    split: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Where one source rank's tokens of each expert go, for one (micro-batch, layer).

    home_phys [E] (``log2phy[l]``), home [E] (home rank), replicas [G, r] (-1 empty) or None, split [E, G]
    (this source's row of :func:`split_counts`) -> ``phys`` int64 [E, G] (physical id of ``e``'s copy on
    rank ``g``) and ``bound`` int64 [E, G] (``cumsum(split, axis=1)``: the copy of a token is the number of
    bounds its rank among ``e``'s tokens reaches).
    """
    e_total, g_total = split.shape
    phys = np.broadcast_to(np.asarray(home_phys, dtype=np.int64)[:, None], (e_total, g_total)).copy()
    if replicas is not None:
        gpu, slot = np.nonzero(replicas >= 0)
        phys[replicas[gpu, slot], gpu] = layout.replica_id(gpu, slot)
    held = np.asarray(home)[:, None] == np.arange(g_total)
    if replicas is not None:
        held[replicas[gpu, slot], gpu] = True
    bad = (split > 0) & ~held
    if bad.any():
        e, g = np.argwhere(bad)[0]
        raise ValueError(
            f"the plan sends {split[e, g]} tokens of expert {e} to rank {g}, which is neither its home "
            f"({home[e]}) nor holds a replica of it; assign and replicas must agree"
        )
    return phys, np.cumsum(split, axis=1).astype(np.int64)


class ReplicatingRouter(nn.Module):
    """Megatron's logical ``TopKRouter`` followed by the logical -> physical relabelling of its routes.

    ``forward(hidden [S, B, H]) -> (probs [T, P], routing_map [T, P])`` over the ``P = E + G * r`` physical
    experts. Without a micro-batch table every expert's tokens go to its home row (``log2phy``); with one
    (:meth:`set_table`), each token goes to the copy the plan's split gives it.
    """

    def __init__(self, logical: nn.Module, layout: PhysicalLayout) -> None:
        super().__init__()
        self.logical: Any = logical
        self.layout = layout
        self.log2phy = torch.arange(layout.num_experts, dtype=torch.long)
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
        routing_map = mask.new_zeros((t, self.layout.num_physical)).scatter(1, phys, mask)
        phys_probs = probs.new_zeros((t, self.layout.num_physical)).scatter(1, phys, probs)
        return phys_probs, routing_map


def replicating_router(layout: PhysicalLayout) -> Callable[..., ReplicatingRouter]:
    """A router builder for ``MoESubmodules(router=...)``: a logical ``TopKRouter`` over ``E`` experts
    (the layer's config copied with ``num_moe_experts = E``) wrapped in a :class:`ReplicatingRouter`."""
    from megatron.core.transformer.moe.router import TopKRouter

    def build(*, config: Any, pg_collection: Any = None) -> ReplicatingRouter:
        if config.num_moe_experts != layout.num_physical:
            raise ValueError(
                f"the MoE layer's config has num_moe_experts={config.num_moe_experts}; a replicating layer "
                "needs "
                f"the physical count E + G * r = {layout.num_physical}"
            )
        logical = copy.deepcopy(config)
        logical.num_moe_experts = layout.num_experts
        return ReplicatingRouter(TopKRouter(config=logical, pg_collection=pg_collection), layout)

    return build


class _OnBackward(torch.autograd.Function):
    """Identity whose backward first calls ``callback`` (a hook at a fixed point of the layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, callback: Callable[[], None]) -> torch.Tensor:  # type: ignore[override]
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.callback()
        return grad, None


@dataclass(frozen=True)
class _LayerStep:
    """What one layer does in the current micro-batch on this rank."""

    copies: SlotCopies
    table: tuple[np.ndarray, np.ndarray]


def _expert_params(mlp: Any) -> tuple[Any, Any]:
    return mlp.linear_fc1.weight, mlp.linear_fc2.weight


class MegatronPlanAdapter:
    """Applies ReLibra plans to a stack of Megatron ``MoELayer`` s on this rank (module docstring).

    ``layers``: the model's MoE layers in order, each built with ``num_moe_experts = E + G * r``, a
    :func:`replicating_router` and ``SequentialMLP`` experts (``E / G + r`` local experts, no bias).
    Every rank of the EP group (the default process group) builds its adapter at the same time.
    """

    def __init__(self, layers: Sequence[nn.Module], layout: PhysicalLayout) -> None:
        if not dist.is_initialized() or dist.get_world_size() != layout.num_gpus:
            raise ValueError(
                f"the adapter needs torch.distributed initialised with world size = EP size = "
                f"{layout.num_gpus}"
            )
        self.layers: list[Any] = list(layers)
        self.layout = layout
        self.rank = dist.get_rank()
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.router, ReplicatingRouter):
                raise TypeError(
                    f"layer {i}: router is {type(layer.router).__name__}; build it with replicating_router"
                )
            got = len(layer.experts.local_experts)
            if got != layout.slots_per_gpu:
                raise ValueError(
                    f"layer {i} has {got} local experts; expected E / G + r = {layout.slots_per_gpu}"
                )
        self.phy2log = layout.static_phy2log(len(self.layers))
        """int64 [L, G, E / G]: the logical expert in each home row."""
        fc1, fc2 = _expert_params(self.layers[0].experts.local_experts[0])
        self._shapes = (fc1.shape, fc2.shape)
        self.params_per_expert = fc1.numel() + fc2.numel()
        self.buffer = ReplicaBuffer(layout.replica_slots, self.params_per_expert, dtype=fc1.dtype)
        """The layer-shared replica buffer; every layer's replica slots are views of its rows."""
        self._bind_replica_slots()
        self._steps: list[_LayerStep | None] = [None] * len(self.layers)
        self._sync_routers()
        for i, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._pre_hook(i), with_kwargs=True)
            layer.register_forward_hook(self._post_hook(i))

    # ------------------------------------------------------------------------------------------ state
    @property
    def home(self) -> np.ndarray:
        """int64 [L, E]: home rank of each logical expert."""
        out = np.empty((len(self.layers), self.layout.num_experts), dtype=np.int64)
        gpu = np.broadcast_to(np.arange(self.layout.num_gpus)[:, None], self.phy2log.shape[1:])
        for layer in range(len(self.layers)):
            out[layer, self.phy2log[layer].reshape(-1)] = gpu.reshape(-1)
        return out

    def home_rows(self, layer: int) -> list[Any]:
        """This rank's home-row expert MLPs of ``layer`` (row ``i`` holds ``phy2log[layer, rank, i]``)."""
        return list(self.layers[layer].experts.local_experts[: self.layout.experts_per_gpu])

    def replica_slots(self, layer: int) -> list[Any]:
        """This rank's replica-slot MLPs of ``layer`` (views of the layer-shared buffer)."""
        return list(self.layers[layer].experts.local_experts[self.layout.experts_per_gpu :])

    def replica_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters backed by the replica buffer: leave them out of the optimizer."""
        return [
            p
            for layer in range(len(self.layers))
            for m in self.replica_slots(layer)
            for p in _expert_params(m)
        ]

    def slot_of(self, layer: int) -> dict[int, int]:
        """Logical expert -> home row on this rank."""
        return {int(e): i for i, e in enumerate(self.phy2log[layer, self.rank])}

    def expert_weights(self, layer: int) -> dict[int, torch.Tensor]:
        """This rank's home experts of ``layer``: logical id -> flat weights [P] (fc1 then fc2)."""
        return {int(e): self._flat(m) for e, m in zip(self.phy2log[layer, self.rank], self.home_rows(layer))}

    def expert_grads(self, layer: int) -> dict[int, torch.Tensor]:
        """This rank's home experts of ``layer``: logical id -> flat weight gradient [P] (zeros if none)."""
        out = {}
        for e, m in zip(self.phy2log[layer, self.rank], self.home_rows(layer)):
            out[int(e)] = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in _expert_params(m)
                ]
            )
        return out

    def load_expert_weights(self, layer: int, weights: Callable[[int], torch.Tensor]) -> None:
        """Set each home row's weights from ``weights(logical_id) -> flat [P]`` (per global expert id)."""
        with torch.no_grad():
            for e, m in zip(self.phy2log[layer, self.rank], self.home_rows(layer)):
                self._unflatten_into(m, weights(int(e)))

    @staticmethod
    def _flat(mlp: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in _expert_params(mlp)])

    def _unflatten_into(self, mlp: nn.Module, flat: torch.Tensor) -> None:
        fc1, fc2 = _expert_params(mlp)
        fc1.copy_(flat[: fc1.numel()].view_as(fc1))
        fc2.copy_(flat[fc1.numel() :].view_as(fc2))

    def _bind_replica_slots(self) -> None:
        """Point every layer's replica-slot weights at the buffer's rows (one buffer for all layers)."""
        n1 = int(np.prod(self._shapes[0]))
        for layer in range(len(self.layers)):
            for s, mlp in enumerate(self.replica_slots(layer)):
                fc1, fc2 = _expert_params(mlp)
                fc1.data = self.buffer.weights[s, :n1].view(self._shapes[0])
                fc2.data = self.buffer.weights[s, n1:].view(self._shapes[1])

    def _sync_routers(self) -> None:
        table = log2phy(self.layout, self.phy2log)
        for layer, module in enumerate(self.layers):
            module.router.log2phy = torch.as_tensor(table[layer], dtype=torch.long)

    def _local_weights(self, layer: int) -> torch.Tensor:
        """[E / G, P]: this rank's home experts of ``layer``, packed for sending to replica slots."""
        return torch.stack([self._flat(m) for m in self.home_rows(layer)])

    # ------------------------------------------------------------------------------------- micro-batch
    def set_microbatch(self, plan: BatchPlan, m: int) -> None:
        """Use micro-batch ``m`` (local to the plan's batch) of ``plan`` for the next forward and backward.

        The plan's placement must be in place (:meth:`apply_placement`); the routes replayed must be the
        ones the plan's ``load`` was counted from.
        """
        if plan.redundant is not None:
            raise ValueError(
                "plan.redundant is set: permanent redundant slots (EPLB+, LPLB+) are not supported here"
            )
        if not np.array_equal(np.asarray(plan.home), self.home):
            raise ValueError(
                "plan.home differs from the model's placement; call apply_placement(plan.home) first"
            )
        num_layers, r = len(self.layers), self.layout.replica_slots
        if plan.assign.shape[1:] != (num_layers, self.layout.num_experts, self.layout.num_gpus):
            raise ValueError(
                f"plan.assign[m] has shape {plan.assign.shape[1:]}; expected [L, E, G] = "
                f"{(num_layers, self.layout.num_experts, self.layout.num_gpus)}"
            )
        if plan.replicas is not None and plan.replicas.shape[-1] > r:
            raise ValueError(
                f"plan.replicas has {plan.replicas.shape[-1]} slots per rank; the model has r = {r}"
            )
        home_phys = log2phy(self.layout, self.phy2log)
        for layer in range(num_layers):
            split = split_counts(plan.load[m, layer], plan.assign[m, layer])[self.rank]  # [E, G]
            replicas = None if plan.replicas is None else np.asarray(plan.replicas[m, layer])
            table = slot_table(self.layout, home_phys[layer], plan.home[layer], replicas, split)
            copies = (
                SlotCopies((), ())
                if replicas is None
                else SlotCopies.from_slots(replicas, np.asarray(plan.home[layer]), self.rank)
            )
            self._steps[layer] = _LayerStep(copies=copies, table=table)
            self.layers[layer].router.set_table(table)

    def clear_microbatch(self) -> None:
        """Back to home-only routing without replicas (e.g. rollout forwards that record routes)."""
        self._steps = [None] * len(self.layers)
        for layer in self.layers:
            layer.router.set_table(None)

    def _fill(self, layer: int, copies: SlotCopies) -> None:
        if not copies.empty:
            self.buffer.fills += 1
            fill_slots(self.buffer.weights, copies, self._local_weights(layer), self.slot_of(layer)).wait()

    def _reduce_grads(self, layer: int, copies: SlotCopies) -> None:
        """Send replica-slot gradients home, add the received ones into home gradients, free the slots'."""
        slot_grads = self.buffer.grads
        slot_grads.zero_()
        n1 = int(np.prod(self._shapes[0]))
        for s, mlp in enumerate(self.replica_slots(layer)):
            fc1, fc2 = _expert_params(mlp)
            if fc1.grad is not None:
                slot_grads[s, :n1] = fc1.grad.reshape(-1)
            if fc2.grad is not None:
                slot_grads[s, n1:] = fc2.grad.reshape(-1)
            fc1.grad = fc2.grad = None
        if copies.empty:
            return
        acc = slot_grads.new_zeros((self.layout.experts_per_gpu, self.params_per_expert))
        reduce_slot_grads(slot_grads, copies, acc, self.slot_of(layer), tag_base=REDUCE_TAG_BASE)
        for row in sorted({self.slot_of(layer)[e] for _, _, e in copies.send}):
            fc1, fc2 = _expert_params(self.home_rows(layer)[row])
            for p, g in ((fc1, acc[row, :n1]), (fc2, acc[row, n1:])):
                if p.grad is None:
                    p.grad = g.view_as(p).clone()
                else:
                    p.grad.add_(g.view_as(p))

    def _pre_hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            step = self._steps[layer]
            if step is None:
                return None
            self._fill(layer, step.copies)
            if not torch.is_grad_enabled() or self.layout.replica_slots == 0:
                return None
            key = "hidden_states"
            x = kwargs[key] if key in kwargs else args[0]
            if not x.requires_grad:
                raise ValueError(
                    f"layer {layer}: the MoE input does not require grad, so replica gradients could not be "
                    "reduced "
                    "home in backward; make the input require grad or run under torch.no_grad()"
                )
            x = _OnBackward.apply(x, lambda: self._reduce_grads(layer, step.copies))
            if key in kwargs:
                return args, {**kwargs, key: x}
            return (x, *args[1:]), kwargs

        return hook

    def _post_hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            step = self._steps[layer]
            if step is None or step.copies.empty or not torch.is_grad_enabled():
                return None
            out, bias = output
            return _OnBackward.apply(out, lambda: self._fill(layer, step.copies)), bias

        return hook

    # -------------------------------------------------------------------------------------- placement
    def apply_placement(self, new_home: np.ndarray, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Move experts to placement new_home [L, E] (collective over the EP group). Returns moved experts.

        Each moved expert carries its weights, its gradients (when present) and every optimizer state
        tensor shaped like its parameters (Adam's moments), all packed into one message.
        """
        new_home = np.asarray(new_home, dtype=np.int64)
        if new_home.shape != (len(self.layers), self.layout.num_experts):
            raise ValueError(
                f"new_home has shape {new_home.shape}; expected [L, E] = "
                f"{(len(self.layers), self.layout.num_experts)}"
            )
        old = self.phy2log
        new = next_phy2log(old, new_home)
        old_home = self.home
        moved = int((old_home != new_home).sum())
        for layer in np.unique(np.nonzero(old_home != new_home)[0]):
            self._move_layer(int(layer), old[layer], new[layer], old_home[layer], new_home[layer], optimizer)
        self.phy2log = new
        self._sync_routers()
        self.clear_microbatch()
        return moved

    @staticmethod
    def _row_tensors(mlp: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
        return [t for p in _expert_params(mlp) for t in param_state_tensors(p, optimizer)]

    def _move_layer(
        self,
        layer: int,
        old: np.ndarray,
        new: np.ndarray,
        old_home: np.ndarray,
        new_home: np.ndarray,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        rank, rows = self.rank, self.home_rows(layer)
        old_row = {int(e): i for i, e in enumerate(old[rank])}
        new_row = {int(e): i for i, e in enumerate(new[rank])}
        outgoing = [int(e) for e in old[rank] if new_home[e] != rank]
        incoming = [int(e) for e in new[rank] if old_home[e] != rank]
        # Step 1: pack every outgoing expert before any incoming one overwrites its freed row.
        send = {
            e: torch.cat([t.reshape(-1) for t in self._row_tensors(rows[old_row[e]], optimizer)])
            for e in outgoing
        }
        recv = {
            e: torch.empty(sum(t.numel() for t in self._row_tensors(rows[new_row[e]], optimizer)))
            for e in incoming
        }
        tag = MOVE_TAG_BASE + layer * self.layout.num_experts
        ops = [dist.P2POp(dist.isend, send[e], int(new_home[e]), tag=tag + e) for e in outgoing]
        ops += [dist.P2POp(dist.irecv, recv[e], int(old_home[e]), tag=tag + e) for e in incoming]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        # Step 2: unpack into the freed rows (weights, gradients, optimizer state in the same order).
        with torch.no_grad():
            for e in incoming:
                start = 0
                for t in self._row_tensors(rows[new_row[e]], optimizer):
                    t.copy_(recv[e][start : start + t.numel()].view_as(t))
                    start += t.numel()
