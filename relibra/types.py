"""Core data types shared by every stage of the pipeline.

Glossary (docs/glossary.md): ``E`` experts per MoE layer, ``L`` MoE layers, ``k`` top-k, ``G`` GPUs of the EP
group, ``S`` samples, ``B`` batches, ``M`` micro-batches (global index over all batches).
Every array is a plain numpy array; every dataclass is frozen. Shapes are written under each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SampleCounts:
    """Per-sample expert counts, the sufficient statistic of a routing trace (docs/architecture.md,
    "The pipeline").

    ``counts[s].sum(axis=-1) == tokens[s] * top_k`` for every sample and layer.
    """

    counts: np.ndarray
    """int32 [S, L, E]: tokens of sample ``s`` routed to expert ``e`` at layer ``l``."""
    tokens: np.ndarray
    """int64 [S]: tokens of each sample."""
    batch_offsets: np.ndarray
    """int64 [B + 1]: batch ``b`` owns samples ``batch_offsets[b]:batch_offsets[b+1]``."""
    top_k: int
    sample_domain: np.ndarray | None = None
    """int16 [S] or None: index into ``domain_names``."""
    domain_names: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    @property
    def num_batches(self) -> int:
        return int(len(self.batch_offsets) - 1)

    def batch(self, b: int) -> slice:
        """Sample slice of batch ``b``."""
        return slice(int(self.batch_offsets[b]), int(self.batch_offsets[b + 1]))


@dataclass(frozen=True)
class Workload:
    """Loads ``x[m, l, j, e]`` of every micro-batch, with the sample layout that produced them."""

    load: np.ndarray
    """int32 [M, L, G, E]: tokens held by source GPU ``j`` that layer ``l`` routes to expert ``e``."""
    tokens: np.ndarray
    """int64 [M, G]: tokens each GPU holds in micro-batch ``m`` (drives attention time)."""
    causal_pairs: np.ndarray
    """float64 [M, G]: attention pairs of the GPU's samples (``AttentionSpan.pairs``, mean over the layers:
    ``len * (len + 1) / 2`` per sample under full causal attention, :mod:`relibra.attention_span`)."""
    sample_gpu: np.ndarray
    """int32 [S]: GPU that processes sample ``s``."""
    sample_mb: np.ndarray
    """int32 [S]: global micro-batch index of sample ``s``."""
    mb_batch: np.ndarray
    """int32 [M]: batch of micro-batch ``m`` (non-decreasing)."""
    top_k: int

    @property
    def num_microbatches(self) -> int:
        return int(self.load.shape[0])

    @property
    def num_gpus(self) -> int:
        return int(self.load.shape[2])

    def batch_microbatches(self, b: int) -> np.ndarray:
        """int64 [Mb]: global micro-batch indices of batch ``b``."""
        return np.flatnonzero(self.mb_batch == b)


@dataclass(frozen=True)
class OnlineCopies:
    """How an online planner (UltraEP, LLEP) plans and copies weights after a layer's routing.

    Such a planner sees a micro-batch's routing only when the layer runs, so its planning and its weight
    copies sit between routing and expert compute (the *critical path*), instead of being planned before
    training and refilled behind attention as ReLibra's layer-shared buffer is. The simulator prices the
    copies of ``BatchPlan.replicas`` on the fabric from each expert's home (NVLink inside a node, the rail
    NICs across nodes) and charges them as this record says.
    """

    critical_path_s: np.ndarray
    """float64 [Mb, L]: planning seconds on the critical path of each (micro-batch, layer)."""
    exposed_copies: int
    """Copies of the slots' bytes charged in full per (micro-batch, layer): the forward fill and, where the
    method copies again in backward or waits for its gradient return, that pass too."""
    overlapped_gradient_reduce: bool
    """One more pass (replica gradients reduced home) overlaps the backward attention; only its excess over
    the backward attention is exposed."""
    fixed_slots: bool = True
    """The copies live in ``replica_slots`` fixed slots per GPU (UltraEP's redundant buffers); False: foreign
    weights are allocated per transfer (LLEP), so no slot count bounds them."""
    token_capacity: np.ndarray | None = None
    """int64 [Mb, L] or None: the per-GPU compute-token bound the method plans to (LLEP's
    ``max_tokens_per_gpu``, its memory bound), checked by :func:`relibra.invariants.check_token_capacity`."""
    over_capacity: np.ndarray | None = None
    """bool [Mb, L, G] or None: GPUs the method had to load past ``token_capacity`` (LLEP's forced spill
    when no GPU had room left)."""


@dataclass(frozen=True)
class BatchPlan:
    """What a planner decides for one batch: placement, per-micro-batch assignment, slot contents.

    The weight transfers the plan implies (``replicas``, ``redundant``, ``online``, ``host_path``, the moved
    homes) are read in one place, :func:`relibra.cost.transfers.plan_transfers`, into the batch's transfer
    schedule.

    ``assign[m, l, e, :].sum() == load[m, l, :, e].sum()`` (token conservation). Each source GPU splits
    its tokens for expert ``e`` over ``e``'s copies in proportion to ``assign[m, l, e, :]`` (the
    *proportional split rule*, shared by the cost model and the executors).
    """

    home: np.ndarray
    """int32 [L, E]: home GPU of each expert during this batch (``E / G`` experts per GPU)."""
    assign: np.ndarray
    """int32 [Mb, L, E, G]: tokens of expert ``e`` computed on GPU ``g`` in the batch's micro-batch ``m``."""
    load: np.ndarray
    """int32 [Mb, L, G, E]: the loads the planner saw (after any sample re-assignment)."""
    sample_gpu: np.ndarray
    """int32 [Sb]: GPU of each of the batch's samples (may differ from the input: locality round)."""
    replicas: np.ndarray | None = None
    """int32 [Mb, L, G, r] or None: expert in each layer-shared replica slot (-1 empty)."""
    redundant: np.ndarray | None = None
    """int32 [L, G, R] or None: expert in each permanent redundant slot (-1 empty; EPLB+, LPLB+)."""
    plan_time_s: float = 0.0
    """Wall-clock seconds the planner spent on this batch."""
    stats: dict[str, float] = field(default_factory=dict)
    """Planner-specific scalars (``reorder_moved_experts``, ``prediction_hit_rate``, ...)."""
    online: OnlineCopies | None = None
    """Set by online planners that plan and copy after routing (UltraEP, LLEP); None: planned before the
    batch, replica slots refilled behind attention."""
    host_path: bool = False
    """The replica slots are filled by a transfer engine that also reads host memory (ForeMoE): each copy
    takes the faster of the fabric from its home and the host link (:meth:`CostModel.engine_copy_time`);
    False: over the fabric alone."""
