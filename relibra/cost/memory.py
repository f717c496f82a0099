"""Per-GPU memory of a training step under the parallel dimensions (the check behind
``simulator.memory_check``).

For each pipeline stage (:mod:`relibra.parallel`), one GPU holds:

* **parameters**: the stage's bf16 weights (:meth:`~relibra.cost.step.WholeStepTerms.stage_parameters`,
  ``simulator.migration.weight_bytes`` per parameter);
* **gradients**: Megatron-core's gradient buffer, in the parameters' dtype unless gradients are reduced
  in fp32 (``megatron/core/distributed/param_and_grad_buffer.py``: ``grad_dtype``), so
  ``training.grad_reduce_bytes_per_param`` per parameter;
* **optimizer state**: the fp32 master weight and Adam's two moments
  (``simulator.migration.master_weight_bytes + optimizer_state_bytes``, 12 bytes), sharded by the
  distributed optimizer over the data-parallel group for dense parameters and over the expert-data-parallel
  group for expert ones (Megatron's estimate ``6 + 12 / d`` bytes per parameter with fp32 gradients,
  ``megatron/training/theoretical_memory_usage.py``);
* **activations** of the micro-batches in flight (:func:`activation_bytes_per_token`, Korthikanti et al.
  2022, arXiv 2205.05198, Section 4's accounting of the tensors each backward needs, for this model's
  shape). 1F1B keeps ``pp - s`` micro-batches in flight on stage ``s`` (at most ``M``), and the interleaved
  schedule multiplies it by ``1 + (pp - 1) / (pp * vpp)`` (Megatron's ``interleaved_schedule_memory_penalty``,
  same file); the last stage also holds one micro-batch's logits for the loss (Megatron's
  ``4 * s * b * h * (1 + V / h)`` bytes) and stage 0 the input ids (8 bytes a token, per micro-batch in
  flight);
* **the replica buffer**: ``planner.replica_slots`` bf16 experts (:mod:`relibra.cost.buffer_memory`).

Sequence parallelism shards every activation over the tensor-parallel group, so per GPU they are counted
per token the GPU holds. Not counted (so the estimate is a floor): the CUDA context and allocator
fragmentation, communication buffers, and the transient FP8 weight copies. Routed-expert activations are
counted at the balanced share (``top_k`` slots per held token); an imbalanced plan's busiest GPU holds more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.buffer_memory import replica_buffer_bytes
from relibra.cost.migration import MigrationPayload
from relibra.cost.step import ParallelGroups, TrainingSpec
from relibra.parallel import ParallelDims

__all__ = [
    "MEMORY_CHECKS",
    "MemoryEstimate",
    "activation_bytes_per_token",
    "in_flight_microbatches",
    "memory_estimate",
]

MEMORY_CHECKS = ("error", "warn", "off")
"""Values of ``simulator.memory_check``: refuse a configuration that does not fit, warn, or skip the check."""
BF16_BYTES = 2
FP32_BYTES = 4
INPUT_ID_BYTES = 8
"""int64 token ids at the embedding's input (Megatron's estimate: ``8 * s * b`` per micro-batch)."""
LOSS_BYTES_PER_VALUE = 4
"""Megatron's estimate of the output layer and loss: ``4 * s * b * h * (1 + V / h)`` bytes per micro-batch,
i.e. 4 bytes per token and (hidden + vocabulary) unit."""


class _Cost(Protocol):
    cluster: ClusterSpec
    model: ModelSpec
    parallel: ParallelDims
    training: TrainingSpec | None
    migration: MigrationPayload

    def stage_parameters(self, stage: int = 0) -> tuple[float, float]: ...

    def stage_layer_counts(self, stage: int) -> tuple[int, int]: ...

    def _groups(self) -> ParallelGroups: ...


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU of the most loaded pipeline stage (module doc)."""

    stage: int
    params: float
    grads: float
    optimizer: float
    activations: float
    replica_buffer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.replica_buffer

    def describe(self) -> str:
        gb = 1e9
        return (
            f"{self.total / gb:.1f} GB on a GPU of stage {self.stage} (parameters {self.params / gb:.1f}, "
            f"gradients {self.grads / gb:.1f}, optimizer state {self.optimizer / gb:.1f}, activations "
            f"{self.activations / gb:.1f}, replica buffer {self.replica_buffer / gb:.2f})"
        )


def activation_bytes_per_token(
    model: ModelSpec, recompute: str, moe: bool, modules: tuple[str, ...] = ("core_attn",)
) -> float:
    """Bytes one layer keeps for its backward per token a GPU holds (bf16; router scores fp32).

    Attention block: the norm's input, the QKV GEMM's input, Q, K and V (FlashAttention's backward reads
    them; no ``s x s`` scores are stored), the core attention's output (the output projection's input) and
    FlashAttention's fp32 log-sum-exp per head. MoE block: the norm's and the router's inputs, the fp32
    router scores, and per routed slot (``top_k`` per token) the first expert GEMM's input, its gate and up
    outputs and the SwiGLU output (the second GEMM's input; the probability multiply is folded into
    SwiGLU), plus the shared experts' gate/up and SwiGLU outputs. A dense layer's FFN: its norm's and first
    GEMM's inputs, gate/up and SwiGLU outputs. Under ``full`` recompute a layer keeps only its input (the
    caller adds one layer's full set for the layer being recomputed).

    Under ``selective``, ``modules`` (``training.recompute_modules``, :mod:`relibra.cost.recompute`) drop
    what they recompute: ``core_attn`` the core attention's output; ``layernorm`` a MoE layer's pre-MLP
    norm output (the router's input; the other norms are fused into their linears and keep nothing of
    their own); ``moe_act`` each slot's SwiGLU output; ``shared_experts`` the shared experts' block but its
    input; ``moe`` the MoE block but its input and its norm's input; ``mlp`` a dense FFN's block but its
    norm's input; ``mla_up_proj`` MLA's queries, keys and values.

    With multi-head latent attention the attention block keeps the norm's and the down projections'
    inputs, each latent's norm input and up projection input (``q_lora``, ``kv_lora``), the keys' RoPE
    part, then the heads' queries, keys (``H * qk_head_dim`` each) and values (``H * value_head_dim``) and
    the core attention's output (``H * value_head_dim``).
    """
    m = model
    h = m.hidden
    if recompute == "full":
        return float(BF16_BYTES * h)
    drop = set(modules) if recompute == "selective" else set()
    if m.mla:
        latents = 2 * (m.q_lora_rank + m.kv_lora_rank) + m.qk_rope_head_dim
        heads = 0 if "mla_up_proj" in drop else m.num_heads * (2 * m.qk_head_dim + m.value_head_dim)
        attn = BF16_BYTES * (2 * h + latents + heads) + FP32_BYTES * m.num_heads
        core_out = m.num_heads * m.value_head_dim
    else:
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        attn = BF16_BYTES * (2 * h + q + 2 * kv) + FP32_BYTES * m.num_heads
        core_out = q
    if "core_attn" not in drop:
        attn += BF16_BYTES * core_out
    if moe and "moe" in drop:
        ffn = BF16_BYTES * (2 * h - h * ("layernorm" in drop))
    elif moe:
        slot = h + (2 if "moe_act" in drop else 3) * m.moe_ffn
        ffn = (
            BF16_BYTES * (2 * h - h * ("layernorm" in drop))
            + FP32_BYTES * m.num_experts
            + m.top_k * BF16_BYTES * slot
            + (0 if "shared_experts" in drop else m.shared_experts * BF16_BYTES * 3 * m.shared_ffn)
        )
    elif "mlp" in drop:
        ffn = BF16_BYTES * h
    else:
        ffn = BF16_BYTES * (2 * h + 3 * m.dense_ffn)
    return float(attn + ffn)


def in_flight_microbatches(parallel: ParallelDims, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: ``min(M, pp - stage)``,
    times ``1 + (pp - 1) / (pp * vpp)`` with the interleaved schedule (module doc)."""
    pp, vpp = parallel.pp, parallel.vpp
    n = float(min(microbatches, pp - stage))
    if vpp > 1:
        n *= 1.0 + (pp - 1) / (pp * vpp)
    return n


def memory_estimate(
    cost: _Cost, tokens_per_gpu: float, microbatches: int, replica_slots: int
) -> MemoryEstimate:
    """The most loaded stage's per-GPU bytes for micro-batches of ``tokens_per_gpu`` tokens per GPU,
    ``microbatches`` per step and ``replica_slots`` replica slots (module doc)."""
    spec = cost.training
    if spec is None:
        raise ValueError("the memory check needs a TrainingSpec (training.*)")
    m, par, pay = cost.model, cost.parallel, cost.migration
    groups = cost._groups()
    dp, edp = groups.dp, groups.edp
    buffer = float(replica_buffer_bytes(m, replica_slots))
    best: MemoryEstimate | None = None
    for s in range(par.pp):
        dense, expert = cost.stage_parameters(s)
        nd, nm = cost.stage_layer_counts(s)
        state = pay.master_weight_bytes + pay.optimizer_state_bytes
        opt = state * (dense / dp + expert / edp) if spec.distributed_optimizer else state * (dense + expert)
        modules = spec.recompute_modules
        per_token = nd * activation_bytes_per_token(m, spec.recompute, moe=False, modules=modules) + nm * (
            activation_bytes_per_token(m, spec.recompute, moe=True, modules=modules)
        )
        if spec.recompute == "full":  # the layer being recomputed holds its whole set
            per_token += max(
                activation_bytes_per_token(m, "none", moe=nm > 0),
                activation_bytes_per_token(m, "none", moe=False) if nd else 0.0,
            )
        flight = in_flight_microbatches(par, s, microbatches)
        acts = tokens_per_gpu * (per_token * flight)
        if s == 0:
            acts += tokens_per_gpu * INPUT_ID_BYTES * flight
        if s == par.pp - 1:
            acts += tokens_per_gpu * LOSS_BYTES_PER_VALUE * (m.hidden + m.vocab)
        est = MemoryEstimate(
            stage=s,
            params=(dense + expert) * pay.weight_bytes,
            grads=(dense + expert) * spec.grad_reduce_bytes_per_param,
            optimizer=opt,
            activations=acts,
            replica_buffer=buffer,
        )
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best
