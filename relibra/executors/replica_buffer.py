"""The layer-shared replica buffer: ``r`` expert slots per GPU, allocated once, reused by every layer.

Before a layer's MoE compute each GPU fills its slots with the weights of that (micro-batch, layer)'s
replicated experts, received from their home GPUs (same node: NVLink in the paper's testbed) with batched
point-to-point ops that are started before the attention stand-in and waited for after it, so the copy
overlaps the layer's attention. In backward the layer refills the slots (the buffer meanwhile held later
layers' replicas), and every replica's weight gradient is sent back and added to its home expert's gradient.

The same two primitives serve permanent redundant slots (EPLB+ / LPLB+): :func:`fill_slots` copies home
weights into any slot store and :func:`reduce_slot_grads` adds slot gradients into the home gradients.

Shapes: ``P = 3 * hidden * ffn`` values per expert (gate, up, down flattened, see ``torch_moe``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["FillHandle", "ReplicaBuffer", "SlotCopies", "fill_slots", "reduce_slot_grads"]


@dataclass(frozen=True)
class SlotCopies:
    """Which slot copies one rank receives and sends for one layer (and micro-batch).

    Built from a slot table ``slots [G, s]`` (expert per slot, -1 empty) and ``home [E]``.
    """

    recv: tuple[tuple[int, int, int], ...]
    """(slot, expert, source home GPU) for every filled slot of this rank, by slot."""
    send: tuple[tuple[int, int, int], ...]
    """(destination GPU, destination slot, expert) for every slot elsewhere that holds one of this rank's
    home experts, by destination then slot."""

    @classmethod
    def from_slots(cls, slots: np.ndarray, home: np.ndarray, rank: int) -> SlotCopies:
        """slots int [G, s], home int [E] -> this rank's copies.

        A slot naming its own GPU's home expert, or an expert an earlier slot of that GPU already holds, is
        left empty (EPLB may place two physical copies of one expert on one GPU; they compute as one).
        """
        num_gpus, width = slots.shape
        safe = np.maximum(slots, 0)
        useful = (slots >= 0) & (home[safe] != np.arange(num_gpus)[:, None])
        earlier = (slots[:, :, None] == slots[:, None, :]) & np.tri(width, k=-1, dtype=bool)[None]
        useful &= ~earlier.any(axis=-1)
        recv = tuple(
            (int(s), int(slots[rank, s]), int(home[slots[rank, s]])) for s in np.flatnonzero(useful[rank])
        )
        dst, slot = np.nonzero(useful & (home[safe] == rank))
        send = tuple((int(g), int(s), int(slots[g, s])) for g, s in zip(dst, slot))
        return cls(recv=recv, send=send)

    @property
    def empty(self) -> bool:
        return not self.recv and not self.send


class FillHandle:
    """Pending slot fill; :meth:`wait` blocks until every copy has landed and returns the seconds waited."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> float:
        t0 = time.perf_counter()
        for w in self._works:
            w.wait()
        self._works = []
        return time.perf_counter() - t0


def _run(ops: list[dist.P2POp]) -> list[dist.Work]:
    return list(dist.batch_isend_irecv(ops)) if ops else []


def fill_slots(
    store: torch.Tensor,
    copies: SlotCopies,
    local_weights: torch.Tensor,
    slot_of: dict[int, int],
    tag_base: int = 0,
) -> FillHandle:
    """Start copying home weights into ``store``; returns at once.

    store [s, P] (this rank's slots), local_weights [E / G, P] (this rank's home experts),
    ``slot_of[e]`` the row of expert ``e`` in ``local_weights``. Message tags are ``tag_base + slot``.
    """
    src = local_weights.detach()
    ops = [dist.P2POp(dist.irecv, store[s], peer, tag=tag_base + s) for s, _, peer in copies.recv]
    ops += [dist.P2POp(dist.isend, src[slot_of[e]], g, tag=tag_base + s) for g, s, e in copies.send]
    return FillHandle(_run(ops))


def reduce_slot_grads(
    slot_grads: torch.Tensor,
    copies: SlotCopies,
    local_grad: torch.Tensor,
    slot_of: dict[int, int],
    tag_base: int = 0,
) -> None:
    """Send every slot's weight gradient home and add the received ones into ``local_grad`` (in place).

    slot_grads [s, P], local_grad [E / G, P]. Received gradients are added in (destination, slot) order, so
    the sum is deterministic.
    """
    staging = slot_grads.new_empty((len(copies.send), slot_grads.shape[1]))
    ops = [
        dist.P2POp(dist.isend, slot_grads[s].contiguous(), peer, tag=tag_base + s)
        for s, _, peer in copies.recv
    ]
    ops += [
        dist.P2POp(dist.irecv, staging[i], g, tag=tag_base + s) for i, (g, s, _) in enumerate(copies.send)
    ]
    for w in _run(ops):
        w.wait()
    if copies.send:
        rows = torch.tensor(
            [slot_of[e] for _, _, e in copies.send], dtype=torch.long, device=local_grad.device
        )
        local_grad.index_add_(0, rows, staging)


class ReplicaBuffer:
    """``r`` replica slots of one expert each, for weights and for their gradients; one per GPU.

    Allocated once: :attr:`nbytes` depends on ``r`` and the expert shape only, never on the layer count.
    """

    def __init__(
        self,
        slots: int,
        params_per_expert: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if slots < 0:
            raise ValueError(f"replica_slots={slots}; expected >= 0")
        self.slots = slots
        self.weights = torch.zeros((slots, params_per_expert), dtype=dtype, device=device)
        """[r, P]: the experts of the layer currently being computed."""
        self.grads = torch.zeros((slots, params_per_expert), dtype=dtype, device=device)
        """[r, P]: their weight gradients during that layer's backward."""
        self.fills = 0
        """Number of fills so far (one per layer forward and one per layer backward)."""

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.grads.nbytes

    def start_fill(
        self, copies: SlotCopies, local_weights: torch.Tensor, slot_of: dict[int, int]
    ) -> FillHandle:
        """Start filling the slots for one layer (overlap with attention, then ``wait()``)."""
        self.fills += 1
        return fill_slots(self.weights, copies, local_weights, slot_of)

    def reduce_grads(self, copies: SlotCopies, local_grad: torch.Tensor, slot_of: dict[int, int]) -> None:
        """Add the slots' gradients (:attr:`grads`) into the home experts' gradients."""
        reduce_slot_grads(self.grads, copies, local_grad, slot_of)
