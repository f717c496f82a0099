"""Force-balanced: Megatron-LM with ``--moe-router-force-load-balancing`` (docs/glossary.md).

Megatron-core's ``TopKRouter`` (``megatron/core/transformer/moe/router.py``), with
``moe_router_force_load_balancing`` set, replaces the router's logits by random ones
(``apply_random_logits``: normal noise of the logits' shape) before its top-k, so every token picks ``k``
distinct experts uniformly at random; everything else (the sample layout, the static contiguous placement,
the all-to-all) is unchanged. It is the benchmark mode NVIDIA's published Megatron-core MoE performance
tables are measured in, so it is the realistic ceiling of a static placement: the imbalance left is the
sampling noise of uniform routing.

Here it is Megatron-LM's planner (:class:`baselines.megatron.MegatronPlanner`) run on the batch's samples,
with their own lengths and the run's sample layout, but routed by :func:`uniform_routing` instead of the
trace: the entry point applies it when the planner config says ``routing: uniform``
(``experiments/conf/planner/force_balanced.yaml``), so the simulator, the invariant checks and the plan
dump see a consistent workload (the dump's ``meta.routing`` says ``uniform``; its ``load`` is not the
trace's).

Choices the source leaves open: the routing is drawn once per run from the run's seed, per (sample,
layer) as a multinomial of the sample's ``tokens * k`` routed slots over the ``E`` experts. Top-k over
random logits draws ``k`` distinct experts per token, which gives each expert's count ``(E - k) / (E - 1)``
of the multinomial's variance (0.94 for 128 experts, top-8): the multinomial is very slightly less balanced
than Megatron's mode.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from baselines.megatron import MegatronPlanner
from relibra.types import SampleCounts

__all__ = ["ROUTINGS", "force_balanced", "uniform_routing"]

ROUTINGS = ("trace", "uniform")
"""Values of the planner config's ``routing`` key: the trace's routing, or uniform top-k (force-balanced)."""


def uniform_routing(counts: SampleCounts, seed: int) -> SampleCounts:
    """The same samples (tokens, batches, domains) routed by uniform top-k.

    Args:
        counts: per-sample counts (``counts.counts`` int32 [S, L, E], ``counts.tokens`` int64 [S]).
        seed: the run's seed.
    Returns:
        :class:`SampleCounts` with counts int32 [S, L, E], ``counts[s, l].sum() == tokens[s] * top_k``.
    """
    s, num_layers, num_experts = counts.counts.shape
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x46B]))
    slots = np.repeat(np.asarray(counts.tokens, dtype=np.int64) * counts.top_k, num_layers)  # [S * L]
    drawn = rng.multinomial(slots, np.full(num_experts, 1.0 / num_experts))  # [S * L, E]
    meta = {**counts.meta, "routing": "uniform"}
    return replace(counts, counts=drawn.reshape(s, num_layers, num_experts).astype(np.int32), meta=meta)


def force_balanced(name: str, replica_slots: int, routing: str) -> MegatronPlanner:
    """Hydra factory: Megatron-LM's planner; ``routing`` must be ``uniform`` (the entry point applies it).

    No defaults: ``planner/force_balanced.yaml`` holds the keys, since the entry point reads
    ``planner.routing`` from the config before it builds the planner."""
    if routing != "uniform":
        raise ValueError(f"planner.routing={routing!r}: force-balanced routes uniformly; use 'uniform'")
    return MegatronPlanner(name=name, replica_slots=replica_slots)
