"""A tiny Qwen3-MoE checkpoint config and the CPU stand-ins under which mbridge builds Megatron's model
(shared by the mbridge model test and the verl engine test; none of them is on ReLibra's side).

* :func:`qwen3_moe_config`: a Hugging Face ``Qwen3MoeConfig`` small enough for a CPU forward; ``rope_theta``
  copied onto the config where ``transformers`` 5 moved it into ``rope_parameters`` (mbridge 0.15.1 reads
  the attribute).
* :data:`CPU_OFF`: the CUDA-only fusions of ``TransformerConfig``, turned off.
* :func:`replica_plan`: a micro-batch's plan with replicas of the hottest experts, from recorded routes.
* :func:`cpu_stand_ins`: Megatron's local layer spec where mbridge asks for Transformer Engine's (their
  parameter names differ only in the input norm, which TE fuses into the QKV projection, so that one name is
  mapped to TE's before mbridge's own mapping), and the RNG tracker's fork a no-op (dropout is off).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from relibra.types import BatchPlan

CPU_OFF = (
    "persist_layer_norm", "gradient_accumulation_fusion", "apply_rope_fusion", "bias_activation_fusion",
    "masked_softmax_fusion", "bias_dropout_fusion", "moe_router_fusion", "moe_permute_fusion",
)  # fmt: skip


def qwen3_moe_config(num_layers: int, hidden: int, ffn: int, num_experts: int, top_k: int, vocab: int) -> Any:
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(  # type: ignore[call-arg]
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, moe_intermediate_size=ffn,
        num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=num_experts, num_experts_per_tok=top_k, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=128, norm_topk_prob=True,
    )  # fmt: skip
    if not hasattr(config, "rope_theta"):
        rope: Any = config.rope_parameters
        object.__setattr__(config, "rope_theta", rope["rope_theta"])
    return config


def cpu_stand_ins() -> None:
    import mbridge.core.llm_bridge as llm_bridge
    from mbridge.models.qwen3moe import Qwen3MoEBridge
    from megatron.core.tensor_parallel import random as tp_random

    if getattr(llm_bridge, "_relibra_cpu_spec", False):
        return  # idempotent: one process may build several engines
    te_spec = llm_bridge.get_gpt_decoder_block_spec
    llm_bridge.get_gpt_decoder_block_spec = lambda config, use_transformer_engine=True, **kw: te_spec(
        config, use_transformer_engine=False, **kw
    )
    llm_bridge._relibra_cpu_spec = True  # type: ignore[attr-defined]
    mapping = Qwen3MoEBridge._weight_name_mapping_mcore_to_hf

    def te_names(self, name):  # type: ignore[no-untyped-def]
        te = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        return mapping(self, te)

    Qwen3MoEBridge._weight_name_mapping_mcore_to_hf = te_names  # type: ignore[method-assign]
    tp_random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


def replica_plan(routes: list[np.ndarray], home: np.ndarray, replica_slots: int, seed: int) -> BatchPlan:
    """One micro-batch's plan for every rank's recorded routes [T, L, k] (rank order): the loads they
    count, the placement ``home`` [L, E], on every rank ``replica_slots`` replicas of the layer's hottest
    experts homed elsewhere, and each expert's tokens split at random over its copies (the same draw on
    every rank)."""
    rng = np.random.default_rng(seed)
    world, (num_layers, num_experts) = len(routes), home.shape
    load = np.zeros((1, num_layers, world, num_experts), dtype=np.int32)
    for g, r in enumerate(routes):
        for layer in range(num_layers):
            np.add.at(load[0, layer, g], r[:, layer].ravel(), 1)
    replicas = np.full((1, num_layers, world, replica_slots), -1, dtype=np.int32)
    assign = np.zeros((1, num_layers, num_experts, world), dtype=np.int32)
    for layer in range(num_layers):
        total = load[0, layer].sum(axis=0)
        hot = np.argsort(-total, kind="stable")
        for g in range(world):
            replicas[0, layer, g, :replica_slots] = [e for e in hot if home[layer, e] != g][:replica_slots]
        for e in range(num_experts):
            copies = np.union1d(np.flatnonzero((replicas[0, layer] == e).any(axis=1)), [home[layer, e]])
            cuts = np.sort(rng.integers(0, total[e] + 1, len(copies) - 1))
            assign[0, layer, e, copies] = np.diff(np.concatenate([[0], cuts, [total[e]]]))
    return BatchPlan(
        home=home.astype(np.int32), assign=assign, load=load, sample_gpu=np.arange(world, dtype=np.int32),
        replicas=replicas,
    )  # fmt: skip
