"""Trained routes that differ from the replayed ones: routing replay off or partial.

With routing replay (docs/glossary.md, "oracle loads") the training step routes every token exactly as the
rollout did, so a replay-based planner plans on the very loads it is priced on. Without it, the training
engine's router recomputes each token's top-k from its own logits, and numerical differences between the
inference and the training kernels flip a share of them: in Qwen3-30B-A3B about 10 % of the (token, layer)
routers choose a different top-k set in training than in inference, and 94 % of tokens differ in at least
one layer (Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv 2510.11370, as NVIDIA/Megatron-LM issue #4168 quotes it). Partial replay (some layers or tokens
replayed, e.g. NeMo RL's replay that leaves MTP routers on their own routing) leaves that share on the
rest. :func:`trained_counts` makes the trained per-sample counts from the replayed ones:

* **amount**: ``mismatch`` is the fraction of each (sample, layer)'s routed slots that are re-drawn,
  ``round(mismatch * slots)`` of its ``tokens * k`` slots (0: exact replay, the counts returned as they
  are; 1: every slot re-drawn). R3's 10 % of routers is ``0.1 / k`` of the slots when a differing router
  swaps one of its ``k`` experts (0.0125 at top-8) and ``0.1`` when it swaps all of them.
* **which slots leave**: drawn uniformly among the sample's slots of the layer (a multivariate
  hypergeometric over its counts), so each expert loses slots in proportion to what it held.
* **where they go**: drawn from the layer's expert popularity over the batch's replayed routes (the
  batch's counts summed over samples). The training router has the rollout's weights, so a token whose
  route flips takes a near-tie expert, one the layer's routing picks anyway; the layer's popularity over
  the batch is what the rollout shows of that. A re-drawn slot may land on the expert it left (with that
  expert's popularity share; ``1 / E`` on a uniform layer), so the share of slots whose expert changes is
  somewhat below ``mismatch``.
* **a token's experts stay distinct**: no count exceeds the sample's tokens (the count form of top-k
  picking ``k`` distinct experts); a slot drawn for an expert without room is drawn again among the experts
  with room, and where every expert with room has popularity 0 in the batch, uniformly among them.

Each (sample, layer) keeps its ``tokens * k`` slots, so tokens per sample, the layout and the attention
work are the replay's. Deterministic in ``seed``: batch ``b`` draws from ``SeedSequence([seed, STREAM, b])``.

Choices left open: the amount is the same for every layer and sample (a partial replay that replays whole
layers is an average over them here); where the re-drawn slots go is the batch's popularity, not the
sample's own (a sample's next-best experts would be closer to its own routing and move less load) nor
uniform (which would spread load the router never puts there); the rollout routes a planner sees are taken
as the ones recorded, whatever the replay setting.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from relibra.types import SampleCounts

__all__ = ["STREAM", "redrawn_slots", "trained_counts"]

STREAM = 0x52335233
"""Second word of every batch's seed sequence, so that these draws share no stream with the other users
of the run's seed (the synthetic generator, force-balanced's uniform routing)."""


def redrawn_slots(slots: np.ndarray, mismatch: float) -> np.ndarray:
    """int64 [...]: slots re-drawn of ``slots`` [...] routed slots each: ``round(mismatch * slots)``,
    halves rounded up."""
    if not 0.0 <= mismatch <= 1.0:
        raise ValueError(f"mismatch={mismatch}: the re-drawn fraction of routed slots must be in [0, 1]")
    return np.floor(mismatch * np.asarray(slots, dtype=np.int64) + 0.5).astype(np.int64)


def _leaving(counts: np.ndarray, leave: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """int64 [R, E]: slots that leave each expert, ``leave`` [R] of the counts [R, E] of each row drawn
    without replacement (a multivariate hypergeometric, one expert at a time)."""
    out = np.zeros_like(counts)
    left_total = counts.sum(axis=1)
    left_draw = leave.copy()
    for e in range(counts.shape[1]):
        rows = np.flatnonzero(left_draw)
        if rows.size == 0:
            break
        good = counts[rows, e]
        taken = rng.hypergeometric(good, left_total[rows] - good, left_draw[rows])
        out[rows, e] = taken
        left_total[rows] -= good
        left_draw[rows] -= taken
    return out


def _arriving(
    room: np.ndarray, arrive: np.ndarray, weights: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """int64 [R, E]: ``arrive`` [R] slots of each row drawn from ``weights`` [R, E] with at most ``room``
    [R, E] per expert (module doc: redrawn where an expert is full; uniform over the experts with room where
    every one of them has weight 0)."""
    out = np.zeros_like(room)
    room = room.copy()
    left = arrive.copy()
    while (rows := np.flatnonzero(left)).size:
        open_ = room[rows] > 0
        if not open_.any(axis=1).all():  # NOTE: cannot happen while E >= k; a guard, not a branch
            raise ValueError("a sample has more re-drawn slots than room for them (top_k > num_experts?)")
        w = np.where(open_, weights[rows], 0.0)
        total = w.sum(axis=1, keepdims=True)
        w = np.where(total > 0, w / np.where(total > 0, total, 1.0), open_ / open_.sum(axis=1, keepdims=True))
        # every draw lands on an expert with room, so each round places at least one slot of every row
        take = np.minimum(rng.multinomial(left[rows], w), room[rows])
        out[rows] += take
        room[rows] -= take
        left[rows] -= take.sum(axis=1)
    return out


def trained_counts(counts: SampleCounts, mismatch: float, seed: int) -> SampleCounts:
    """The counts the training step routes when ``mismatch`` of every (sample, layer)'s slots are re-drawn
    (module doc).

    Args:
        counts: replayed per-sample counts (``counts.counts`` int32 [S, L, E], ``tokens`` int64 [S]).
        mismatch: fraction in [0, 1] of each (sample, layer)'s routed slots re-drawn.
        seed: the run's seed.
    Returns:
        ``counts`` itself when ``mismatch`` is 0; else the same samples with counts int32 [S, L, E] such
        that ``out[s, l].sum() == counts[s, l].sum()``, ``out[s, l, e] <= tokens[s]`` and ``meta``'s
        ``replay_mismatch`` set.
    """
    redrawn_slots(np.zeros(0), mismatch)  # NOTE: the range check, before any work
    if mismatch == 0.0:
        return counts
    replayed = np.asarray(counts.counts, dtype=np.int64)
    num_s, num_l, num_e = replayed.shape
    out = np.empty((num_s, num_l, num_e), dtype=np.int32)
    cap = np.asarray(counts.tokens, dtype=np.int64)
    for b in range(counts.num_batches):
        sl = counts.batch(b)
        rng = np.random.default_rng(np.random.SeedSequence([seed, STREAM, b]))
        c = replayed[sl]  # [Sb, L, E]
        sb = c.shape[0]
        popularity = np.broadcast_to(c.sum(axis=0, dtype=np.float64), c.shape)  # [Sb, L, E]
        # Step 1: the slots that leave, uniformly among each (sample, layer)'s slots.
        flat = c.reshape(sb * num_l, num_e)
        move = redrawn_slots(flat.sum(axis=1), mismatch)  # [Sb * L]
        kept = flat - _leaving(flat, move, rng)
        # Step 2: where they go, the layer's popularity over the batch, at most tokens[s] per expert.
        room = np.repeat(cap[sl], num_l)[:, None] - kept  # [Sb * L, E]
        weights = popularity.reshape(sb * num_l, num_e)
        out[sl] = (kept + _arriving(room, move, weights, rng)).reshape(sb, num_l, num_e)
    return replace(counts, counts=out, meta={**counts.meta, "replay_mismatch": float(mismatch)})
