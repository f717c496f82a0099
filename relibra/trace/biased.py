"""Routing of known skew: Megatron-core's force-biased router, and a model's measured expert popularity.

Both give per-sample counts ``c[s, l, e]`` (:class:`relibra.types.SampleCounts`) for samples whose lengths
are already set, as :func:`baselines.force_balanced.uniform_routing` does for uniform routing; they are the
routing sources of the imbalance-penalty check (:mod:`experiments.validation.penalty`), where how skewed the
routing is must be known, not guessed.

* :func:`force_biased_shares`: Megatron-core's ``moe_router_force_biased`` (NVIDIA/Megatron-LM
  ``megatron/core/transformer/moe/router.py`` and ``moe_utils.py: apply_biased_logits``, read at d98e8a6):
  each token's logits are replaced by standard normal draws (``RandomSTE``) and a per-expert bias
  ``b[e] ~ N(0, |std|)`` shared by every rank is added (``RandomSTEShared``); a negative ``std`` draws the
  bias once per layer and keeps it, which is the mode modelled here (a positive one redraws it every forward
  pass, i.e. per micro-batch and layer, and is not). Top-k then picks the ``k`` largest. The share of
  tokens that include expert ``e`` has no closed form; it is estimated from ``tokens`` exact top-k draws
  per layer (a Monte-Carlo error of about ``sqrt(q / tokens)``).
* :func:`popularity_counts`: a measured per-layer popularity (e.g. the real Qwen3 counts of
  ``../shared/traces/qwen3-moe-counts``), the same for every sample.

Per sample, the ``T k`` slots are drawn as one multinomial over the inclusion shares with every count at
most ``T`` (:func:`relibra.trace.synthetic.counts_from_probs`, which documents the approximation: tokens
are independent, and the negative correlation between one token's experts is ignored). Neither source
models per-sample drift beyond sampling noise: the fluctuation of a micro-batch's loads around the
layer's popularity is the multinomial's only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from relibra.trace.synthetic import counts_from_probs
from relibra.types import SampleCounts

__all__ = ["force_biased_shares", "popularity_counts"]

MC_TOKENS = 16384
"""Tokens drawn per layer to estimate the force-biased inclusion shares (module doc)."""


def force_biased_shares(
    num_layers: int, num_experts: int, top_k: int, std: float, seed: int, tokens: int = MC_TOKENS
) -> np.ndarray:
    """float64 [L, E]: each expert's share of a layer's routed slots under Megatron's force-biased router
    with the bias drawn once per layer (module doc); every row sums to 1.

    ``std``: the bias' standard deviation (0: uniform routing, ``1 / E`` each).
    """
    if not std >= 0:
        raise ValueError(f"force-biased std={std!r}: expected a number >= 0 (the bias' |std|)")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must lie in [1, num_experts={num_experts}]")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xB1A5]))
    shares = np.empty((num_layers, num_experts))
    for layer in range(num_layers):
        bias = rng.normal(0.0, std, num_experts)  # [E], shared by every token of the layer
        logits = rng.standard_normal((tokens, num_experts)) + bias  # [T, E]
        top = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]  # [T, k]
        shares[layer] = np.bincount(top.ravel(), minlength=num_experts) / (tokens * top_k)
    return shares


def popularity_counts(counts: SampleCounts, shares: np.ndarray, seed: int, name: str) -> SampleCounts:
    """The same samples (tokens, batches) routed by the per-layer expert ``shares``.

    Args:
        counts: per-sample counts (only ``tokens`` int64 [S], the shape [S, L, E] and ``top_k`` are read).
        shares: float [L, E], each row the layer's share of routed slots per expert (non-negative, sums to
            1; an expert's share above ``1 / k`` is capped at one slot per token, the excess redrawn).
        seed: the run's seed.
        name: what the routing is, recorded in ``meta["routing"]``.
    Returns:
        :class:`SampleCounts` with counts int32 [S, L, E], ``counts[s, l].sum() == tokens[s] * top_k``.
    """
    s, num_layers, num_experts = counts.counts.shape
    p = np.asarray(shares, dtype=np.float64)
    if p.shape != (num_layers, num_experts):
        raise ValueError(
            f"routing shares of shape {p.shape}: expected (layers, experts) = {(num_layers, num_experts)}"
        )
    if not np.isfinite(p).all() or (p < 0).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-9):
        raise ValueError("routing shares: each layer's row must be finite, non-negative and sum to 1")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x509]))
    tokens = np.asarray(counts.tokens, dtype=np.int64)
    drawn = counts_from_probs(np.broadcast_to(p, (s, num_layers, num_experts)), tokens, counts.top_k, rng)
    return replace(counts, counts=drawn, meta={**counts.meta, "routing": name})
