"""Run ReLibra plans inside megatron-core's ``MoELayer``: placement, replication, replica gradients.

Glossary (docs/glossary.md, plus EPLB's words for the physical side):

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
   by the integer split rule (``relibra.executors.split.split_counts``): source rank ``j`` sends
   ``split[j, e, g]`` of its tokens for ``e`` to the copy on rank ``g``, in token order, copies by
   ascending rank; summed over sources, each copy computes exactly the plan's ``assign``;
4. **replica gradients**: an autograd hook at the layer's input, reached after the layer's expert
   backward, sends every replica slot's weight gradient to the home rank and adds it into the home
   expert's gradient (``relibra.executors.replica_buffer.reduce_slot_grads``).

Outputs and gradients equal those of the plain layer with the same routes (up to float summation order).

Limits: the EP group must be the whole default process group (ranks are GPUs); permanent redundant slots
(EPLB+, LPLB+) and activation recomputation of the MoE layer are not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from relibra.executors.reorder_ops import promoted_dtype
from relibra.executors.replica_buffer import ReplicaBuffer, SlotCopies, fill_slots, reduce_slot_grads
from relibra.executors.split import split_counts
from relibra.megatron.optimizer_state import main_grad, row_state_tensors
from relibra.megatron.physical import PhysicalExpertMap, log2phy, next_phy2log, slot_table
from relibra.megatron.router import ReplicatingRouter
from relibra.types import BatchPlan

__all__ = [
    "MegatronPlanAdapter",
]

REDUCE_TAG_BASE = 1 << 13
"""P2P tags of replica-gradient reduction start here (fills use the slot index)."""
MOVE_TAG_BASE = 1 << 14
"""P2P tags of placement moves start here."""


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


def _take_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient ``p`` holds (``p.grad``, else DDP's ``main_grad``), copied out; both are cleared."""
    main = main_grad(p)
    out = None if p.grad is None else p.grad.detach().clone()
    if main is not None:
        out = main.detach().clone() if out is None else out + main.detach()
        main.zero_()
    p.grad = None
    return out


def _add_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Add ``g`` into the gradient the optimizer reads: DDP's ``main_grad`` if any, else ``p.grad``."""
    main = main_grad(p)
    if main is not None:
        main.add_(g.to(main.dtype))
    elif p.grad is None:
        p.grad = g.clone()
    else:
        p.grad.add_(g)


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat message of ``tensors`` in their promoted dtype (exact: promotion only widens)."""
    dtype = promoted_dtype(tensors)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


def _empty_pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The receive buffer of :func:`_pack` ``(tensors)``."""
    numel = sum(t.numel() for t in tensors)
    return torch.empty(numel, dtype=promoted_dtype(tensors), device=tensors[0].device)


class MegatronPlanAdapter:
    """Applies ReLibra plans to a stack of Megatron ``MoELayer`` s on this rank (module docstring).

    ``layers``: the model's MoE layers in order, each built with ``num_moe_experts = E + G * r``, a
    :func:`replicating_router` and ``SequentialMLP`` experts (``E / G + r`` local experts, no bias).
    Every rank of the EP group (the default process group) builds its adapter at the same time.
    """

    def __init__(self, layers: Sequence[nn.Module], expert_map: PhysicalExpertMap) -> None:
        if not dist.is_initialized() or dist.get_world_size() != expert_map.num_gpus:
            raise ValueError(
                f"the adapter needs torch.distributed initialised with world size = EP size = "
                f"{expert_map.num_gpus}"
            )
        self.layers: list[Any] = list(layers)
        self.expert_map = expert_map
        self.rank = dist.get_rank()
        for i, layer in enumerate(self.layers):
            if not isinstance(layer.router, ReplicatingRouter):
                raise TypeError(
                    f"layer {i}: router is {type(layer.router).__name__}; build it with replicating_router"
                )
            got = len(layer.experts.local_experts)
            if got != expert_map.slots_per_gpu:
                raise ValueError(
                    f"layer {i} has {got} local experts; expected E / G + r = {expert_map.slots_per_gpu}"
                )
        self.phy2log = expert_map.static_phy2log(len(self.layers))
        """int64 [L, G, E / G]: the logical expert in each home row."""
        fc1, fc2 = _expert_params(self.layers[0].experts.local_experts[0])
        self._shapes = (fc1.shape, fc2.shape)
        self.params_per_expert = fc1.numel() + fc2.numel()
        self.buffer = ReplicaBuffer(
            expert_map.replica_slots, self.params_per_expert, dtype=fc1.dtype, device=fc1.device
        )
        """The layer-shared replica buffer, on the rows' device and in their dtype; every layer's replica
        slots are views of its rows."""
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
        out = np.empty((len(self.layers), self.expert_map.num_experts), dtype=np.int64)
        gpu = np.broadcast_to(np.arange(self.expert_map.num_gpus)[:, None], self.phy2log.shape[1:])
        for layer in range(len(self.layers)):
            out[layer, self.phy2log[layer].reshape(-1)] = gpu.reshape(-1)
        return out

    def home_rows(self, layer: int) -> list[Any]:
        """This rank's home-row expert MLPs of ``layer`` (row ``i`` holds ``phy2log[layer, rank, i]``)."""
        return list(self.layers[layer].experts.local_experts[: self.expert_map.experts_per_gpu])

    def grads_in_ddp_buffers(self) -> bool:
        """Whether the home rows' gradients live in Megatron DDP's buffers (``main_grad``): a training
        engine, whose optimizer keeps copies of every row."""
        rows = (row for layer in range(len(self.layers)) for row in self.home_rows(layer))
        return any(main_grad(p) is not None for row in rows for p in _expert_params(row))

    def replica_slots(self, layer: int) -> list[Any]:
        """This rank's replica-slot MLPs of ``layer`` (views of the layer-shared buffer)."""
        return list(self.layers[layer].experts.local_experts[self.expert_map.experts_per_gpu :])

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
        """This rank's home experts of ``layer``: logical id -> flat weight gradient [P] (``p.grad``, else
        Megatron DDP's ``main_grad``; zeros if none)."""

        def grad(p: torch.Tensor) -> torch.Tensor:
            main = main_grad(p)
            if p.grad is not None:
                return p.grad
            return torch.zeros_like(p) if main is None else main

        out = {}
        for e, m in zip(self.phy2log[layer, self.rank], self.home_rows(layer)):
            out[int(e)] = torch.cat([grad(p).reshape(-1) for p in _expert_params(m)])
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
        table = log2phy(self.expert_map, self.phy2log)
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
        num_layers, r = len(self.layers), self.expert_map.replica_slots
        if plan.assign.shape[1:] != (num_layers, self.expert_map.num_experts, self.expert_map.num_gpus):
            raise ValueError(
                f"plan.assign[m] has shape {plan.assign.shape[1:]}; expected [L, E, G] = "
                f"{(num_layers, self.expert_map.num_experts, self.expert_map.num_gpus)}"
            )
        if plan.replicas is not None and plan.replicas.shape[-1] > r:
            raise ValueError(
                f"plan.replicas has {plan.replicas.shape[-1]} slots per rank; the model has r = {r}"
            )
        home_phys = log2phy(self.expert_map, self.phy2log)
        for layer in range(num_layers):
            split = split_counts(plan.load[m, layer], plan.assign[m, layer])[self.rank]  # [E, G]
            replicas = None if plan.replicas is None else np.asarray(plan.replicas[m, layer])
            table = slot_table(self.expert_map, home_phys[layer], plan.home[layer], replicas, split)
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
            for p, part in zip(_expert_params(mlp), (slice(0, n1), slice(n1, None)), strict=True):
                grad = _take_grad(p)
                if grad is not None:
                    slot_grads[s, part] = grad.reshape(-1)
        if copies.empty:
            return
        acc = slot_grads.new_zeros((self.expert_map.experts_per_gpu, self.params_per_expert))
        reduce_slot_grads(slot_grads, copies, acc, self.slot_of(layer), tag_base=REDUCE_TAG_BASE)
        for row in sorted({self.slot_of(layer)[e] for _, _, e in copies.send}):
            fc1, fc2 = _expert_params(self.home_rows(layer)[row])
            for p, g in ((fc1, acc[row, :n1]), (fc2, acc[row, n1:])):
                _add_grad(p, g.view_as(p))

    def _pre_hook(self, layer: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            step = self._steps[layer]
            if step is None:
                return None
            self._fill(layer, step.copies)
            if not torch.is_grad_enabled() or self.expert_map.replica_slots == 0:
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
    def apply_placement(self, new_home: np.ndarray, optimizer: Any | None = None) -> int:
        """Move experts to placement new_home [L, E] (collective over the EP group). Returns moved experts.

        Each moved expert carries its weights, its gradients (when present) and the optimizer's copies of
        it (Adam's moments; a Megatron distributed optimizer's master weights too), all packed into one
        message (:func:`~relibra.megatron.optimizer_state.row_state_tensors`). An optimizer whose copies
        cannot move is refused (``OptimizerStateError``) before any expert moves.
        """
        new_home = np.asarray(new_home, dtype=np.int64)
        if new_home.shape != (len(self.layers), self.expert_map.num_experts):
            raise ValueError(
                f"new_home has shape {new_home.shape}; expected [L, E] = "
                f"{(len(self.layers), self.expert_map.num_experts)}"
            )
        old = self.phy2log
        new = next_phy2log(old, new_home)
        old_home = self.home
        moved = int((old_home != new_home).sum())
        layers = np.unique(np.nonzero(old_home != new_home)[0])
        for layer in layers:  # refuse before the first move, not halfway
            for row in self.home_rows(int(layer)):
                self._row_tensors(row, optimizer)
        for layer in layers:
            self._move_layer(int(layer), old[layer], new[layer], old_home[layer], new_home[layer], optimizer)
        self.phy2log = new
        self._sync_routers()
        self.clear_microbatch()
        return moved

    @staticmethod
    def _row_tensors(mlp: nn.Module, optimizer: Any | None) -> list[torch.Tensor]:
        return [t for p in _expert_params(mlp) for t in row_state_tensors(p, optimizer)]

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
        # One message per expert in one dtype (bf16 weights, fp32 master weights and moments: fp32), on the
        # rows' device; every rank lists the same tensors for a row, so both ends agree on both.
        send = {e: _pack(self._row_tensors(rows[old_row[e]], optimizer)) for e in outgoing}
        recv = {e: _empty_pack(self._row_tensors(rows[new_row[e]], optimizer)) for e in incoming}
        tag = MOVE_TAG_BASE + layer * self.expert_map.num_experts
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
