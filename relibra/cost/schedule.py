"""Megatron's (interleaved) 1F1B pipeline schedule, run op by op over per-micro-batch durations.

A pass through the pipeline is not its slowest stage's mean work times a bubble factor when micro-batches
differ: a slow micro-batch on one stage delays the stages after it (forward) and before it (backward), and
the schedule's fixed order lets no stage run ahead. :func:`simulate_schedule` replays the order every rank
follows in ``megatron/core/pipeline_parallel/schedules.py`` (read at NVIDIA/Megatron-LM d98e8a6):

* ``get_schedule_table``: the forward order of (micro-batch, model chunk) pairs, micro-batches in groups of
  ``microbatch_group_size_per_vp_stage`` (default ``pp``), every chunk of a group before the next group;
  backward ``k`` runs the same micro-batch on chunk ``vpp - 1 - chunk``;
* ``get_pp_rank_microbatches``: rank ``r`` runs ``(pp - r - 1) * 2 + (vpp - 1) * group`` warm-up forwards
  (``pp - r - 1`` without interleaving), at most every one; then one forward and one backward alternate
  (1F1B), then the cool-down backwards.

Dependencies: the forward of micro-batch ``m`` on virtual stage ``v = chunk * pp + rank`` waits for its
forward on ``v - 1``; its backward waits for its backward on ``v + 1`` (the last virtual stage: for its own
forward). Each rank runs its ops in order, each as soon as the rank is free and its input has arrived;
pipeline sends are charged by the caller inside the durations (as :mod:`relibra.cost.pipeline` charges them
exposed). With equal durations the makespan is the busy time times ``1 + (pp - 1) / (vpp M)``, the bubble
:func:`relibra.cost.pipeline.bubble_fraction` prices (tested); what it adds beyond that is the cost of
micro-batches that differ.
"""

from __future__ import annotations

import numpy as np

__all__ = ["rank_order", "simulate_schedule"]


def _schedule_table(microbatches: int, vpp: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward in order (Megatron's ``get_schedule_table``)."""
    table: list[tuple[int, int]] = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table.extend((m, c) for c in range(vpp) for m in range(first, last))
    return table


def rank_order(
    rank: int, pp: int, vpp: int, microbatches: int, forward_only: bool = False
) -> list[tuple[bool, int, int]]:
    """The ops of ``rank`` in order: (is forward, micro-batch, chunk); ``forward_only``: every forward in
    the table's order (Megatron's forward-only schedule runs all as warm-up)."""
    group = pp
    table = _schedule_table(microbatches, vpp, group)
    if forward_only:
        return [(True, m, c) for m, c in table]
    total = microbatches * vpp
    warmup = (pp - rank - 1) * 2 + (vpp - 1) * group if vpp > 1 else pp - rank - 1
    warmup = min(warmup, total)
    ops: list[tuple[bool, int, int]] = [(True, *table[k]) for k in range(warmup)]
    backward = [(False, m, vpp - 1 - c) for m, c in table]
    for i in range(total - warmup):
        ops.append((True, *table[warmup + i]))
        ops.append(backward[i])
    ops.extend(backward[total - warmup :])
    return ops


def simulate_schedule(forward: np.ndarray, backward: np.ndarray, forward_only: bool = False) -> np.ndarray:
    """Seconds at which each rank finishes its last op.

    Args:
        forward: float [pp, vpp, M], seconds of micro-batch ``m``'s forward through chunk ``c`` on rank
            ``r`` (everything the rank does for it: layers, sends).
        backward: float [pp, vpp, M], the same for the backward (unread when ``forward_only``).
        forward_only: a forward-only pass (no backward ops).
    Returns:
        float64 [pp]: each rank's finish time from the step's start.
    """
    fwd, bwd = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
    if fwd.shape != bwd.shape or fwd.ndim != 3:
        raise ValueError(f"forward {fwd.shape} and backward {bwd.shape}: expected equal shapes [pp, vpp, M]")
    pp, vpp, mb = fwd.shape
    stages = pp * vpp
    f_done = np.full((stages, mb), np.nan)  # [V, M] finish of each forward
    b_done = np.full((stages, mb), np.nan)
    orders = [rank_order(r, pp, vpp, mb, forward_only) for r in range(pp)]
    nxt = [0] * pp
    free = np.zeros(pp)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            while nxt[r] < len(order):
                is_fwd, m, c = order[nxt[r]]
                v = c * pp + r
                if is_fwd:
                    ready = 0.0 if v == 0 else f_done[v - 1, m]
                else:
                    ready = f_done[v, m] if v == stages - 1 else b_done[v + 1, m]
                if np.isnan(ready):
                    break
                start = max(free[r], ready)
                free[r] = start + (fwd[r, c, m] if is_fwd else bwd[r, c, m])
                (f_done if is_fwd else b_done)[v, m] = free[r]
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - Megatron's order never deadlocks; guard against a bad order
            raise RuntimeError(f"pipeline schedule pp={pp} vpp={vpp} M={mb} deadlocked")
    return free
