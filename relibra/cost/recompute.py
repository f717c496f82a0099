"""Selective activation recompute: what each module of ``training.recompute_modules`` repeats in the
update's backward (``training.recompute=selective``, Megatron-core's ``recompute_granularity="selective"``).

Megatron-core (``TransformerConfig.recompute_modules``; ``transformer_layer.py``, ``moe/experts.py``,
``moe/moe_layer.py``) recomputes, per layer, in the backward:

* ``core_attn``: the core attention (QK^T, PV) forward, every layer (normal checkpointing);
* ``layernorm``: the input and pre-MLP norms where they are modules of their own. In the Transformer
  Engine layer spec (Megatron-Bridge's) the input norm of every layer and the pre-MLP norm of a dense
  layer are fused into the next linear (``TELayerNormColumnParallelLinear``: an ``IdentityOp`` stands in
  their place and is not recomputed), so this is one RMSNorm forward per MoE layer (``TENorm``), on the
  tokens the GPU holds;
* ``moe_act``: the experts' SwiGLU with the probability multiply, on the slots the GPU *receives*, so it
  follows the plan's ``assign`` like the permutation term it is a share of
  (:meth:`~relibra.cost.step.WholeStepTerms.activation_share`);
* ``shared_experts``: the shared experts' forward, every MoE layer;
* ``mlp``: a dense layer's FFN forward;
* ``mla_up_proj``: multi-head latent attention's query and key-value up projections, every layer (their
  outputs, the heads' queries, keys and values, are not kept; :meth:`relibra.cluster.ModelSpec.mla_up_flops`).
  The RoPE Megatron recomputes with them is elementwise and not priced; a model without MLA is refused;
* ``moe``: the whole MoE layer's forward: router, permutation, dispatch and combine, the experts' GEMMs
  with their FP8 casts, SwiGLU and the shared experts. It contains ``moe_act`` and ``shared_experts``,
  which add nothing beside it.

Forward shares as everywhere in the step (:data:`~relibra.cost.step.FORWARD_FLOPS_SHARE` of a GEMM's
fwd + bwd seconds, :data:`~relibra.cost.step.FORWARD_BYTES_SHARE` of a memory-bound kernel's, half of the
four all-to-all phases), except the two output-discarding modules, whose forwards are counted exactly
(``norm_forward_values_per_hidden``, ``swiglu_forward_values_per_ffn``). Choices left open: under FP8,
the re-cast of a recomputed norm's or activation's output for its GEMM's weight gradient is not priced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from relibra.cost.step import FORWARD_BYTES_SHARE, FORWARD_FLOPS_SHARE
from relibra.cost.work import LayerWork, TokenWork

if TYPE_CHECKING:
    from relibra.cost.model import CostModel

__all__ = ["SelectiveRecompute", "selective_recompute"]


@dataclass(frozen=True)
class SelectiveRecompute:
    """Busiest-GPU seconds that selective recompute adds to the update's backward."""

    moe: np.ndarray
    """float64 [Mb, L]: compute repeated per (micro-batch, MoE layer)."""
    comm: np.ndarray
    """float64 [Mb, L]: all-to-all repeated per (micro-batch, MoE layer) (``moe`` only; else zeros)."""
    dense: np.ndarray
    """float64 [Mb]: compute repeated per micro-batch in one dense layer."""


def _needed(field: np.ndarray | None, module: str, name: str) -> np.ndarray:
    if field is None:
        raise ValueError(f"training.recompute_modules holds {module}, which needs TokenWork.{name}")
    return field


def selective_recompute(cost: CostModel, work: LayerWork, tw: TokenWork) -> SelectiveRecompute:
    """:class:`SelectiveRecompute` of ``cost.training.recompute_modules`` (module doc) for one pass's
    plan-priced MoE work ``work`` [Mb, L] and token work ``tw`` [Mb]."""
    spec = cost.training
    assert spec is not None
    modules = set(spec.recompute_modules)
    f, h = FORWARD_FLOPS_SHARE, FORWARD_BYTES_SHARE
    shape = work.compute.shape
    moe = np.zeros(shape)
    dense = np.zeros_like(tw.core_attn)
    if "core_attn" in modules:
        moe = np.broadcast_to(tw.core_attn[:, None] * f, shape)
        dense = tw.core_attn * f
    if "layernorm" in modules:
        moe = moe + _needed(tw.norm_forward, "layernorm", "norm_forward")[:, None]
    if "mlp" in modules:
        dense = dense + _needed(tw.dense_ffn, "mlp", "dense_ffn") * f
    if "mla_up_proj" in modules:
        if not cost.model.mla:
            raise ValueError(
                f"training.recompute_modules holds mla_up_proj, but model {cost.model.name} has "
                "grouped-query attention (model.kv_lora_rank=0)"
            )
        up = _needed(tw.mla_up, "mla_up_proj", "mla_up") * f
        moe = moe + up[:, None]
        dense = dense + up
    comm = np.zeros_like(work.comm)
    if "moe" in modules:
        shared = _needed(tw.shared, "moe", "shared")
        moe = moe + work.compute * f + (work.permute + tw.router[:, None]) * h + shared[:, None] * f
        if work.cast is not None:
            moe = moe + work.cast * h
        comm = work.comm * 0.5
        return SelectiveRecompute(moe=moe, comm=comm, dense=dense)
    if "moe_act" in modules:
        moe = moe + work.permute * cost.activation_share()
    if "shared_experts" in modules:
        moe = moe + _needed(tw.shared, "shared_experts", "shared")[:, None] * f
    return SelectiveRecompute(moe=moe, comm=comm, dense=dense)
