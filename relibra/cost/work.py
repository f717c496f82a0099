"""What one pass's pricing reads, per micro-batch: the plan-priced MoE work (:class:`LayerWork`) and the
work that follows the tokens each GPU holds (:class:`TokenWork`); built by :mod:`relibra.cost.passes` and
read by it and by :mod:`relibra.cost.recompute`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LayerWork", "TokenWork"]


@dataclass(frozen=True)
class LayerWork:
    """Busiest-GPU seconds of one pass's plan-priced MoE work, fwd + bwd, [Mb, L] each."""

    compute: np.ndarray
    """float64 [Mb, L]: ``max_g T_comp`` (expert grouped GEMMs)."""
    comm: np.ndarray
    """float64 [Mb, L]: ``max_g T_comm`` (dispatch and combine, 4 phases)."""
    permute: np.ndarray
    """float64 [Mb, L]: ``max_g`` permutation and SwiGLU seconds on the received slots (0: MoE-only step)."""
    cast: np.ndarray | None = None
    """float64 [Mb, L]: ``max_g`` FP8 cast seconds of the expert GEMMs on the received slots (None: nothing
    cast, bf16 or the MoE-only step)."""


@dataclass(frozen=True)
class TokenWork:
    """Busiest-GPU seconds of the work that follows the tokens each GPU holds (not the placement), fwd +
    bwd, per micro-batch."""

    attn: np.ndarray
    """float64 [Mb, 1]: one layer's attention and projections."""
    core_attn: np.ndarray
    """float64 [Mb]: one layer's core attention (QK^T, PV), what selective recompute repeats."""
    dense: np.ndarray
    """float64 [Mb]: one dense layer's attention and FFN."""
    router: np.ndarray
    """float64 [Mb]: one MoE layer's router."""
    norm: np.ndarray
    """float64 [Mb]: one layer's norms and residual adds."""
    head: np.ndarray
    """float64 [Mb]: embedding, LM head and loss."""
    head_forward: np.ndarray
    """float64 [Mb]: their forward share (the log-probabilities of a forward-only pass)."""
    tp_block: np.ndarray | None = None
    """float64 [Mb]: one tensor-parallel block's exposed collectives, fwd + bwd (None: ``tp = 1``;
    :func:`relibra.cost.tensor.tp_block_time`)."""
    p2p: np.ndarray | None = None
    """float64 [Mb]: one pipeline send of a micro-batch's activations (or their gradient) between stages
    (None: ``pp = 1``; :func:`relibra.cost.pipeline.p2p_send_time`)."""
    cast_moe: np.ndarray | None = None
    """float64 [Mb]: one MoE layer's FP8 casts of its dense GEMMs (attention projections, shared experts)
    (None: nothing cast, bf16 or the MoE-only step;
    :meth:`~relibra.cost.step.WholeStepTerms.dense_cast_time`)."""
    cast_dense: np.ndarray | None = None
    """float64 [Mb]: one dense layer's FP8 casts (attention projections, FFN) (None: as ``cast_moe``)."""
    norm_forward: np.ndarray | None = None
    """float64 [Mb]: one RMSNorm's forward (``layernorm`` recompute; None: the MoE-only step)."""
    shared: np.ndarray | None = None
    """float64 [Mb]: one MoE layer's shared experts, fwd + bwd, a part of ``attn`` (``shared_experts`` and
    ``moe`` recompute; None: the MoE-only step)."""
    dense_ffn: np.ndarray | None = None
    """float64 [Mb]: one dense layer's FFN, fwd + bwd, a part of ``dense`` (``mlp`` recompute; None: the
    MoE-only step)."""
    mla_up: np.ndarray | None = None
    """float64 [Mb]: one layer's MLA up projections, fwd + bwd, a part of ``attn`` (``mla_up_proj``
    recompute; zeros without MLA; None: the MoE-only step)."""
