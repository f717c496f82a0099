"""A plan made on the replayed routes, run on the routes the training step takes (routing replay off or
partial: :mod:`relibra.trace.mismatch`).

A planner's plan fixes, per (micro-batch, layer), where each expert lives and how its tokens split over its
copies (``assign[m, l, e, :]``; each source GPU splits its tokens of ``e`` in that proportion,
:class:`~relibra.types.BatchPlan`'s *proportional split rule*). When the trained routes differ from the ones
it planned on, the executor keeps the placement, the replica slots, the permanent copies and the sample
layout, and splits each expert's **trained** tokens over the plan's copies in the plan's proportions:
:func:`run_on_trained`. An expert the planner saw no token of has no proportions; its trained tokens run at
its home copy (``home[l, e]``). The integer split rounds down and hands each expert's leftover tokens to the
copies with the largest remainders (ties: the lower GPU), so every expert's copies compute exactly its
trained tokens and no copy the plan left empty gets any.

Which routes each planner receives (the simulator, :func:`relibra.simulator.simulate`), by the information
its card in :mod:`relibra.planners.registry` declares it plans from (:func:`plans_on_replay`):

* a planner that plans from routing replay (``oracle_batch`` or ``oracle_microbatch``: ReLibra and its
  variants, EPLB+, LPLB+, ForeMoE) gets the **replayed** routes, which is what the rollout recorded, and is
  priced on :func:`run_on_trained`;
* every other planner gets the **trained** routes, as its method reads nothing that replay gives: the
  online balancers (``routed_microbatch``: UltraEP, LLEP, MoonEP, ECHO) read the step's own router output,
  PopFetcher the previous layer's routing and the micro-batches already run, Megatron-LM and round-robin
  nothing, and the history-fed EPLB the loads of earlier batches;
* history, for every planner that reads it, is the trained loads of earlier batches (what the training
  step's routers counted), under the layout each plan ran;
* the Balanced bound gets the trained loads (it bounds what the step runs); force-balanced routes uniformly
  by its definition, so replay does not apply to it (the entry point gives it no trained routes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from relibra.planners.protocols import BatchContext, reordered_load
from relibra.planners.registry import card
from relibra.types import BatchPlan, SampleCounts, Workload

__all__ = ["REPLAYED", "TrainedRoutes", "plans_on_replay", "run_on_trained", "split_like"]

REPLAYED = frozenset({"oracle_batch", "oracle_microbatch"})
"""The information (:data:`relibra.planners.registry.INFORMATION`) only routing replay gives: a batch's or a
micro-batch's loads before the step runs."""


def plans_on_replay(name: str) -> bool:
    """Whether planner ``name`` plans from the replayed routes (its card's information meets
    :data:`REPLAYED`); a name without a card is refused (``KeyError`` naming the registered ones), as which
    routes it may see is then unknown."""
    return bool(REPLAYED & set(card(name).information))


@dataclass(frozen=True)
class TrainedRoutes:
    """The routes the training step takes, beside the replayed ones a planner sees."""

    counts: SampleCounts
    """Per-sample counts int32 [S, L, E] of the same samples (tokens, batches) as the replayed counts."""
    workload: Workload
    """Loads int32 [M, L, G, E] of ``counts`` under the replayed workload's layout (the layout depends on the
    tokens only, so it is the same)."""

    def check(self, counts: SampleCounts, workload: Workload) -> None:
        """Refuse trained routes that are not of the replayed samples and layout (names the array)."""
        pairs = {
            "counts.counts shape": (self.counts.counts.shape, counts.counts.shape),
            "counts.tokens": (self.counts.tokens, counts.tokens),
            "counts.batch_offsets": (self.counts.batch_offsets, counts.batch_offsets),
            "workload.sample_gpu": (self.workload.sample_gpu, workload.sample_gpu),
            "workload.sample_mb": (self.workload.sample_mb, workload.sample_mb),
            "workload.mb_batch": (self.workload.mb_batch, workload.mb_batch),
            "workload.tokens": (self.workload.tokens, workload.tokens),
        }
        for name, (trained, replayed) in pairs.items():
            if not np.array_equal(np.asarray(trained), np.asarray(replayed)):
                raise ValueError(f"trained routes: {name} differs from the replayed routes'; they must be "
                                 "the same samples under the same layout")  # fmt: skip


def split_like(assign: np.ndarray, total: np.ndarray, home: np.ndarray) -> np.ndarray:
    """Each expert's ``total`` tokens over its copies in the proportions of ``assign`` (module doc).

    Args:
        assign: int [Mb, L, E, G] the plan's tokens of expert ``e`` on GPU ``g``.
        total: int [Mb, L, E] tokens to split; home: int [L, E] each expert's home GPU.
    Returns:
        int32 [Mb, L, E, G] with ``out.sum(-1) == total`` and ``out > 0`` only where ``assign > 0`` (or at
        the home GPU where ``assign[m, l, e]`` is all zero).
    """
    w = np.asarray(assign, dtype=np.int64)
    g = w.shape[-1]
    at_home = np.arange(g) == np.asarray(home)[None, :, :, None]  # [1, L, E, G]
    weight = w.sum(axis=-1)  # [Mb, L, E]
    w = np.where((weight == 0)[..., None], at_home, w)
    weight = np.maximum(weight, 1)[..., None]
    share = np.asarray(total, dtype=np.int64)[..., None] * w  # [Mb, L, E, G]
    out = share // weight
    left = np.asarray(total, dtype=np.int64) - out.sum(axis=-1)  # [Mb, L, E], < copies with w > 0
    # Step 2: the leftover tokens to the largest remainders; a copy with w = 0 has remainder 0 and rank
    # >= left, as the remainders sum to left * weight with each below weight.
    order = np.argsort(-(share - out * weight), axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(g), order.shape), axis=-1)
    out += rank < left[..., None]
    return out.astype(np.int32)


def run_on_trained(plan: BatchPlan, trained: BatchContext) -> BatchPlan:
    """``plan`` as the training step runs it on the batch's trained routes (``trained``: the batch's
    context built from them): the trained loads [Mb, L, G, E] under the plan's sample layout and each
    expert's trained tokens split in the plan's proportions (:func:`split_like`); placement, replica slots
    and permanent copies unchanged."""
    load = reordered_load(trained, np.asarray(plan.sample_gpu), "trained routes")
    assign = split_like(plan.assign, load.sum(axis=2), plan.home)
    return replace(plan, load=np.ascontiguousarray(load, dtype=np.int32), assign=assign)
