"""A tiny Qwen3-MoE checkpoint config and the CPU stand-ins under which mbridge builds Megatron's model
(shared by the mbridge model test and the verl engine test; none of them is on ReLibra's side).

* :func:`qwen3_moe_config`: a Hugging Face ``Qwen3MoeConfig`` small enough for a CPU forward; ``rope_theta``
  copied onto the config where ``transformers`` 5 moved it into ``rope_parameters`` (mbridge 0.15.1 reads
  the attribute).
* :data:`CPU_OFF`: the CUDA-only fusions of ``TransformerConfig``, turned off.
* :func:`cpu_stand_ins`: Megatron's local layer spec where mbridge asks for Transformer Engine's (their
  parameter names differ only in the input norm, which TE fuses into the QKV projection, so that one name is
  mapped to TE's before mbridge's own mapping), and the RNG tracker's fork a no-op (dropout is off).
"""

from __future__ import annotations

import contextlib
from typing import Any

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
