"""Replication that pays for its replica-buffer refill.

The layer-shared buffer is refilled for every (micro-batch, layer): each copy's weights cross NVLink from
the expert's home while the layer's attention runs, and its gradients go home during the backward
attention; what attention does not hide is exposed (:func:`relibra.cost.transfers.refill_exposed`, the
schedule's pricing the simulator charges). A replicator minimises ``T_MoE`` alone, which is right wherever
the refill is hidden (every quick and paper-scale preset: the exposed share of a step is below 0.1 %), but
on short steps (the OLMoE decode trace: 12,800 tokens a step) a copy can cost more refill than it saves.

:func:`replicate_within_window` keeps the replicator's answer wherever its refill is hidden, and elsewhere
also solves those layers with fewer slots per GPU (``r - 1`` down to ``0``, i.e. every token at home) and
keeps, per layer, the answer with the lowest ``T_MoE`` plus exposed refill, priced by the cost model as
the simulator prices it. With the static placement the home-only answer is Megatron-LM's, so replication
never makes a layer slower than Megatron-LM.

Under ``cluster.ep_overlap`` :func:`replicate_batch` couples the micro-batches of a layer: a second pass
prices each micro-batch's share of the overlapped layer time, and the exact best mix of the two passes is
kept (:func:`replicate_batch`).
"""

from __future__ import annotations

import numpy as np

from relibra.cost.overlap import OverlapNeighbours, best_chain
from relibra.cost.pricing import attention_window, layer_price, layer_terms
from relibra.cost.transfers import refill_exposed
from relibra.planners.protocols import BatchContext, Replication, Replicator

__all__ = ["replicate_batch", "replicate_within_window"]


def replicate_within_window(
    replicator: Replicator,
    load: np.ndarray,
    home: np.ndarray,
    ctx: BatchContext,
    window_s: float,
    overlap: OverlapNeighbours | None = None,
) -> Replication:
    """One micro-batch's replication whose refill pays for itself.

    Args:
        replicator: the replicator (one that is not ``refill_aware`` is used as it is).
        load: [L, G, E] of the micro-batch; home: [L, E]; ctx: the batch (its cost model prices answers).
        window_s: the micro-batch's attention seconds per layer (:func:`attention_window`).
        overlap: under ``cluster.ep_overlap``, the micro-batch's neighbours (one row per layer): handed to
            the replicator, and the answers are compared by their share of the overlapped time.
    Returns:
        :class:`Replication` with ``assign`` [L, E, G] and ``replicas`` [L, G, r] (``r`` of the replicator);
        stats: the replicator's for the full answer, plus ``refill_capped_layers``, the share of layers
        answered with fewer slots.
    """
    window = float(window_s)
    if not (np.isfinite(window) and window >= 0):
        raise ValueError(f"window_s={window_s!r}; expected attention seconds >= 0")
    rep = replicator.replicate(load, home, ctx, overlap)
    slots = replicator.replica_slots if replicator.refill_aware else 0
    stats = dict(rep.stats)
    stats["refill_capped_layers"] = 0.0
    if slots == 0 or not rep.replicas.size:
        return Replication(assign=rep.assign, replicas=rep.replicas, stats=stats)
    exposed = refill_exposed(ctx.cost, rep.replicas, home, window)
    rows = np.flatnonzero(exposed > 0)
    if rows.size == 0:
        return Replication(assign=rep.assign, replicas=rep.replicas, stats=stats)
    assign = np.array(rep.assign, dtype=np.int32)
    replicas = np.array(rep.replicas, dtype=np.int32)
    sub_load, sub_home = load[rows], home[rows]
    sub_overlap = None if overlap is None else overlap.rows(rows)
    best = layer_price(
        sub_load, sub_home, Replication(assign[rows], replicas[rows]), ctx, window, sub_overlap
    )
    capped = np.zeros(rows.size, dtype=bool)
    for k in range(slots - 1, -1, -1):
        alt = replicator.with_slots(k).replicate(sub_load, sub_home, ctx, sub_overlap)
        t = layer_price(sub_load, sub_home, alt, ctx, window, sub_overlap)
        better = t < best
        if better.any():
            take = rows[better]
            assign[take] = alt.assign[better]
            replicas[take] = -1
            replicas[take, :, :k] = alt.replicas[better]
            best = np.where(better, t, best)
            capped |= better
    stats["refill_capped_layers"] = float(capped.sum()) / load.shape[0]
    return Replication(assign=assign, replicas=replicas, stats=stats)


def replicate_batch(
    replicator: Replicator, load: np.ndarray, home: np.ndarray, ctx: BatchContext, sample_gpu: np.ndarray
) -> list[Replication]:
    """Every micro-batch of ``load`` [Mb, L, G, E] on ``home`` [L, E], each within its attention window
    under ``sample_gpu`` [Sb] (what :class:`~relibra.planners.compose.ComposedPlanner` and the control
    plane's replication tasks run).

    Under ``cluster.ep_overlap`` (``ctx.cost``) the micro-batches are coupled through the overlapped layer
    time, so two passes run: first every micro-batch for its own ``T_MoE`` (as without the overlap); then
    every micro-batch again for its share of the overlapped time, its neighbours' terms taken from the
    first pass; finally, per layer, :func:`relibra.cost.overlap.best_chain` picks for each micro-batch the
    first or the second answer so that the layer's overlapped time plus exposed refill is least, exactly.
    So the result is never worse, as the simulator prices it, than the first pass alone. The second pass
    is an approximation (its neighbours are the first pass's, not their own second answers); the exact
    choice between the two passes is what makes it safe. Stats add ``overlap_second_pass_share``: the share
    of (micro-batch, layer) answers taken from the second pass.
    """
    window = attention_window(ctx, sample_gpu)
    mb = load.shape[0]
    first = [replicate_within_window(replicator, load[m], home, ctx, window[m]) for m in range(mb)]
    if not ctx.cost.cluster.ep_overlap or mb < 2:
        return first
    comp, comm, extra = _stack_terms(load, home, first, ctx, window)  # [Mb, L] each
    second = [
        replicate_within_window(
            replicator,
            load[m],
            home,
            ctx,
            window[m],
            OverlapNeighbours.of(comp, comm, window, m, ctx.cost.cluster.comm_sm_share),
        )
        for m in range(mb)
    ]
    comp2, comm2, extra2 = _stack_terms(load, home, second, ctx, window)
    num_layers = load.shape[1]
    pick = np.stack(
        [
            best_chain(
                np.stack([comp[:, l], comp2[:, l]]),
                np.stack([comm[:, l], comm2[:, l]]),
                np.stack([extra[:, l], extra2[:, l]]),
                ctx.cost.cluster.comm_sm_share,
            )
            for l in range(num_layers)
        ],
        axis=1,
    ).astype(bool)  # [Mb, L]: True where the second pass's answer is kept
    share = float(pick.mean())
    out = []
    for m in range(mb):
        take = pick[m][:, None, None]
        stats = dict(first[m].stats)
        stats["overlap_second_pass_share"] = share
        out.append(
            Replication(
                assign=np.where(take, second[m].assign, first[m].assign).astype(np.int32),
                replicas=np.where(take, second[m].replicas, first[m].replicas).astype(np.int32),
                stats=stats,
            )
        )
    return out


def _stack_terms(
    load: np.ndarray, home: np.ndarray, reps: list[Replication], ctx: BatchContext, window: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 [Mb, L] each: compute with attention, all-to-all and exposed refill of every micro-batch."""
    terms = [layer_terms(load[m], home, rep, ctx, window[m]) for m, rep in enumerate(reps)]
    comp = np.stack([t[0] + window[m] for m, t in enumerate(terms)])
    return comp, np.stack([t[1] for t in terms]), np.stack([t[2] for t in terms])
