"""Reordering on real processes: move experts to their new home GPUs between batches.

An expert that changes home takes with it everything the training step keeps per expert: its weights, its
gradient accumulator (``param.grad``) and its optimizer state (every state tensor shaped like the parameter,
e.g. Adam's ``exp_avg`` / ``exp_avg_sq``). Unmoved experts stay in their rows; each incoming expert takes a
row freed by an outgoing one (freed rows ascending get incoming experts ascending).

As vLLM's EPLB (``vllm/distributed/eplb/rebalance_execute.py``) does, one layer moves at a time through a
staging buffer sized for one layer, with batched point-to-point sends: all experts one GPU sends to another
in a layer are packed into one message per (source, destination) pair.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from relibra.executors.torch_moe import EPMoEModel

__all__ = ["moved_experts", "param_state_tensors", "reorder_experts"]


def moved_experts(old_home: np.ndarray, new_home: np.ndarray) -> np.ndarray:
    """old_home [L, E], new_home [L, E] -> int64 [n, 2] of (layer, expert) pairs whose home changes."""
    if old_home.shape != new_home.shape:
        raise ValueError(
            f"placements differ in shape: {old_home.shape} vs {new_home.shape}; expected [L, E] both"
        )
    return np.argwhere(np.asarray(old_home) != np.asarray(new_home)).astype(np.int64)


def promoted_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The one dtype that holds every tensor of ``tensors`` exactly (promotion only widens): the packing
    dtype of a moved expert's rows (bf16 weights with fp32 optimizer state: fp32)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors))


def param_state_tensors(
    param: torch.nn.Parameter, optimizer: torch.optim.Optimizer | None
) -> list[torch.Tensor]:
    """What moves with ``param``: its weights, its gradient (when set) and the optimizer state of the same
    shape (in sorted key order). Row ``i`` of each tensor belongs to row ``i`` of ``param``."""
    out = [param.data]
    if param.grad is not None:
        out.append(param.grad)
    if optimizer is not None:
        state = optimizer.state.get(param, {})
        out += [v for _, v in sorted(state.items()) if torch.is_tensor(v) and v.shape == param.shape]
    return out


def reorder_experts(
    model: EPMoEModel, new_home: np.ndarray, optimizer: torch.optim.Optimizer | None = None
) -> int:
    """Move this rank's share of experts to placement new_home [L, E]; every rank must call it together.

    Returns the number of (layer, expert) pairs that moved (the same on every rank).
    """
    if model.home is None:
        raise RuntimeError("the model has no placement yet; call place_initial first")
    new_home = np.asarray(new_home, dtype=np.int64)
    per_gpu = model.num_experts // model.num_gpus
    counts = np.stack([(new_home == g).sum(axis=1) for g in range(model.num_gpus)], axis=1)
    if (counts != per_gpu).any():
        layer, gpu = np.argwhere(counts != per_gpu)[0]
        raise ValueError(
            f"new_home: layer {layer} puts {counts[layer, gpu]} experts on GPU {gpu}; "
            f"expected E / G = {per_gpu}"
        )
    moves = moved_experts(model.home, new_home)
    rank = model.rank
    staging: tuple[torch.Tensor, ...] | None = None  # the one-layer buffer, reused by every layer
    for layer in np.unique(moves[:, 0]):
        param = model.experts[int(layer)]
        tensors = param_state_tensors(param, optimizer)
        width = param.shape[1]
        dtype = promoted_dtype(tensors)  # fp32 optimizer state of a bf16 parameter travels exactly
        if staging is None or staging[0].shape[1] != width * len(tensors) or staging[0].dtype != dtype:
            staging = tuple(param.new_empty((per_gpu, width * len(tensors)), dtype=dtype) for _ in range(2))
        send_buf, recv_buf = staging
        old, new = model.home[layer], new_home[layer]
        out = [(int(new[e]), int(e)) for e in np.flatnonzero((old == rank) & (new != rank))]  # (dst, expert)
        inc = [(int(old[e]), int(e)) for e in np.flatnonzero((new == rank) & (old != rank))]  # (src, expert)
        out.sort()
        inc.sort()
        slot_of = model.slot_of(int(layer))
        # Step 1: pack outgoing rows, one contiguous block per destination.
        with torch.no_grad():
            for i, (_, e) in enumerate(out):
                row = slot_of[e]
                for k, t in enumerate(tensors):
                    send_buf[i, k * width : (k + 1) * width].copy_(t[row])
        # Step 2: one message per (source, destination) pair.
        ops = []
        for peer in sorted({d for d, _ in out}):
            idx = [i for i, (d, _) in enumerate(out) if d == peer]
            ops.append(dist.P2POp(dist.isend, send_buf[idx[0] : idx[-1] + 1], peer, tag=int(layer)))
        for peer in sorted({s for s, _ in inc}):
            idx = [i for i, (s, _) in enumerate(inc) if s == peer]
            ops.append(dist.P2POp(dist.irecv, recv_buf[idx[0] : idx[-1] + 1], peer, tag=int(layer)))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        # Step 3: incoming experts (ascending) take the freed rows (ascending).
        freed = sorted(slot_of[e] for _, e in out)
        incoming = sorted(range(len(inc)), key=lambda i: inc[i][1])
        with torch.no_grad():
            for row, i in zip(freed, incoming):
                for k, t in enumerate(tensors):
                    t[row].copy_(recv_buf[i, k * width : (k + 1) * width])
                model.slot_expert[layer, row] = inc[i][1]
    model.home = new_home.copy()
    return len(moves)
