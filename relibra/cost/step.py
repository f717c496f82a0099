"""The rest of the whole training step (docs/glossary.md, "whole step"): every term beyond the MoE layers'
expert GEMMs and all-to-all, attention and dense layers, as methods of :class:`relibra.cost.model.CostModel`
(through :class:`WholeStepTerms`), each with its own result column.

Per micro-batch and GPU, from the tokens the GPU holds (``tokens`` [..., G]) or receives (``received``
[..., G], the expert slots ``sum_e assign[e, g]`` of one MoE layer), forward plus backward:

* :meth:`~WholeStepTerms.head_time`: input embedding (gather, then the gradient's scatter-add), the LM head
  GEMM ``2 * hidden * vocab`` FLOPs per token forward (bf16: Megatron's output layer is not an FP8 module)
  and the fused cross-entropy over the vocabulary (HBM-bound, ``loss_bytes_per_logit``);
* :meth:`~WholeStepTerms.router_time` per MoE layer: the router GEMM ``2 * hidden * E`` and its score,
  top-k and auxiliary elementwise work over the ``E`` logits (fp32, ``router_bytes_per_logit``);
* :meth:`~WholeStepTerms.permute_time` per MoE layer: token permutation and un-permutation
  (``permute_values_per_hidden`` bf16 values per received slot and hidden unit) and SwiGLU with the
  probability multiply (``swiglu_values_per_ffn`` per expert-FFN unit), on the slots the GPU *receives*,
  so it follows the plan's ``assign`` (the one balance-dependent term here);
* :meth:`~WholeStepTerms.norm_time` per layer: the two RMSNorms and two residual adds;
* :meth:`~WholeStepTerms.core_attention_time`: the part of attention that selective recompute repeats;
* with ``cluster.precision=fp8``, the casts of every FP8 GEMM's input (forward) and output gradient
  (backward) to FP8 (Transformer Engine's quantizers, ``training.fp8_recipe``):
  :meth:`~WholeStepTerms.expert_cast_time` on the slots a GPU receives (it follows ``assign``, as the
  permutation does), :meth:`~WholeStepTerms.dense_cast_time` on the tokens it holds (attention
  projections with the shared experts, or a dense layer's FFN);
* per step: :meth:`~WholeStepTerms.optimizer_time` (Adam over the parameters and states a GPU holds,
  HBM-bound), :meth:`~WholeStepTerms.grad_reduce_time` and :meth:`~WholeStepTerms.param_gather_time` (the
  distributed optimizer's gradient reduce-scatter and parameter all-gather over the data-parallel group
  for dense parameters and the expert-data-parallel group for expert parameters),
  :meth:`~WholeStepTerms.launch_time` (host overhead per MoE layer and pass, 0 under a full-iteration CUDA
  graph: ``training.cuda_graph``).

Memory-bound terms run at ``hbm_bytes_per_s * hbm_efficiency``; dense GEMMs at the dense peak of
``cluster.precision`` times ``attention_efficiency``. How they join the step (which hide what, recompute,
the RL passes) is :mod:`relibra.cost.pricing`'s. Constants: ``experiments/conf/training/*.yaml`` (kernel
structure, optimizer, gradient formats) and ``experiments/conf/cluster/*.yaml`` (rates), each with its source.

Choices left open (documented in docs/validation.md, "The whole step"): a forward-only pass does a third of
a GEMM's fwd + bwd FLOPs and half of a memory-bound kernel's fwd + bwd bytes; the gradient reduce-scatter
and parameter all-gather run as rings over the data-parallel group, on the rail NICs when the group spans
nodes and on NVLink otherwise, and do not contend with the all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.migration import MigrationPayload
from relibra.parallel import ParallelDims, layer_chunks, stage_layers

__all__ = [
    "CUDA_GRAPHS",
    "FORWARD_BYTES_SHARE",
    "FORWARD_FLOPS_SHARE",
    "FP8_CAST_BYTES",
    "FP8_RECIPES",
    "RECOMPUTE",
    "RECOMPUTE_MODULES",
    "RL_PASSES",
    "STEPS",
    "ParallelGroups",
    "TrainingSpec",
    "WholeStepTerms",
    "parallel_groups",
]

STEPS = ("whole", "moe")
"""Values of ``simulator.step``: the whole training step, or the MoE-only step of earlier releases."""
RECOMPUTE = ("none", "selective", "full")
"""Values of ``training.recompute`` (Megatron's ``recompute_granularity``; ``selective``: the modules of
``training.recompute_modules``)."""
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "mlp", "moe", "shared_experts", "mla_up_proj")
"""Values in ``training.recompute_modules`` (Megatron-core ``TransformerConfig.recompute_modules``, read
only under ``recompute_granularity=selective``; default ``[core_attn]``); priced by
:mod:`relibra.cost.recompute` (``mla_up_proj`` only for a model with multi-head latent attention)."""
CUDA_GRAPHS = ("none", "partial", "full_iteration")
"""Values of ``training.cuda_graph``: what the run captures in CUDA graphs (Megatron-core ``cuda_graph_impl``
and ``cuda_graph_scope``). ``none`` and ``partial`` (attention, router, MoE preprocessing: the scopes
Megatron-Bridge's recipes graph) leave the dropless dispatcher's host sync and the expert path's launches
on the host, so both pay ``host_overhead_s``; ``full_iteration`` (the whole step one graph, experts padded
to a capacity so no host sync is needed) pays none."""
RL_PASSES = ("reference", "recompute", "update")
"""Values in ``workload.rl_passes``: the reference model's forward, the old policy's log-prob recompute
(forward only, the same replayed routing) and the policy update (forward + backward + optimizer)."""
FORWARD_FLOPS_SHARE = 1.0 / 3.0
"""A GEMM's forward share of its fwd + bwd FLOPs (backward computes input and weight gradients)."""
FORWARD_BYTES_SHARE = 0.5
"""A memory-bound kernel's forward share of its fwd + bwd bytes (the backward kernels move about as much;
the per-kernel counts of ``experiments/conf/training/megatron.yaml`` give 0.38-0.5)."""
BF16_BYTES = 2
FP8_CAST_BYTES = {
    "delayed": 2.0 + 1.0 + 1.0,
    "tensorwise": 2.0 + 2.0 + 1.0 + 1.0,
    "mxfp8": 2.0 + 2.0 * (1.0 + 1.0 / 32),
    "blockwise": 2.0 + 2.0 * (1.0 + 4.0 / 128),
}
"""HBM bytes per value cast from bf16 to FP8, by Megatron's ``--fp8-recipe``. Each cast writes the rowwise
copy (for the GEMM that consumes the tensor now) and the columnwise one (for the weight gradient), in one
fused kernel (Transformer Engine ``transformer_engine/common/transpose/cast_transpose.cu`` and
``common/util/cast_kernels.cuh``):

* ``delayed``: the scale comes from the amax history and the kernel records the new amax as it casts:
  read 2, write 1 + 1;
* ``tensorwise`` (current scaling, Megatron-Bridge's ``fp8cs`` recipes): a separate amax kernel reads the
  tensor first (``common/recipe/current_scaling.cu``, ``compute_amax``), then the cast: 2 + 2 + 1 + 1;
* ``mxfp8``: one E8M0 scale per 32 values in each direction, computed inside the cast
  (``cast_mxfp8_2D_kernel``, ``SCALE_DIM_X = SCALE_DIM_Y = 32``): 2 + 2 x (1 + 1 / 32);
* ``blockwise`` (DeepSeek-V3's 1 x 128 and 128 x 128 tiles, fp32 scales): 2 + 2 x (1 + 4 / 128).
"""
FP8_RECIPES = tuple(FP8_CAST_BYTES)
"""Values of ``training.fp8_recipe``."""


@dataclass(frozen=True)
class TrainingSpec:
    """How the trainer runs a step around the MoE layers. Values and sources: ``experiments/conf/training``.

    ``step``, ``rl_passes`` come from ``simulator.step`` and ``workload.rl_passes``; the rest from
    ``training.*``. No field but those two has a default: the kernel counts are written once, in the yaml.
    """

    recompute: str
    """Activation recompute: ``none``, ``selective`` (``recompute_modules``) or ``full`` (every layer's
    forward)."""
    recompute_modules: tuple[str, ...]
    """What ``selective`` recomputes (:data:`RECOMPUTE_MODULES`; Megatron's default ``("core_attn",)``)."""
    overlap_grad_reduce: bool
    """Megatron's ``overlap_grad_reduce``: the reduce-scatter runs behind the last micro-batch's backward."""
    overlap_param_gather: bool
    """Megatron's ``overlap_param_gather``: the all-gather runs behind the first micro-batch's forward."""
    distributed_optimizer: bool
    """Megatron's distributed optimizer (optimizer state and master weights sharded over the data-parallel
    group: reduce-scatter + all-gather); False: every rank holds them all and all-reduces gradients."""
    norm_values_per_hidden: float
    """bf16 values moved per token and hidden unit by one layer's norms and residual adds, fwd + bwd."""
    norm_forward_values_per_hidden: float
    """bf16 values moved per token and hidden unit by one RMSNorm's forward (what ``layernorm`` recompute
    repeats)."""
    embedding_values_per_hidden: float
    """bf16 values moved per token and hidden unit by the input embedding, fwd + bwd."""
    permute_values_per_hidden: float
    """bf16 values moved per received slot and hidden unit by permutation and un-permutation, fwd + bwd."""
    swiglu_values_per_ffn: float
    """bf16 values moved per received slot and expert-FFN unit by SwiGLU with the probability multiply."""
    swiglu_forward_values_per_ffn: float
    """Its forward's share of those values (what ``moe_act`` recompute repeats)."""
    router_bytes_per_logit: float
    """Bytes moved per token and expert by the router's scores, top-k and auxiliary work, fwd + bwd."""
    loss_bytes_per_logit: float
    """Bytes moved per token and vocabulary entry by the fused cross-entropy, fwd + bwd."""
    optimizer_bytes_per_param: float
    """Bytes the Adam step reads and writes per parameter it updates."""
    grad_reduce_bytes_per_param: float
    """Bytes per gradient in the reduce-scatter (bf16: 2, ``grad_reduce_in_fp32``: 4)."""
    param_gather_bytes_per_param: float
    """Bytes per parameter in the all-gather (bf16: 2)."""
    host_overhead_s: float | None
    """Exposed host seconds per MoE layer and pass direction (the dropless dispatcher's host sync and the
    launches after it), paid unless ``cuda_graph`` is ``full_iteration``. None (the default): the GPU
    generation's calibrated value, ``cluster.hardware.host_overhead_s``; a number overrides it."""
    cuda_graph: str
    """``training.cuda_graph`` (:data:`CUDA_GRAPHS`): ``full_iteration`` removes the host overhead."""
    fp8_recipe: str
    """Megatron's ``--fp8-recipe`` (:data:`FP8_RECIPES`): how ``cluster.precision=fp8`` casts GEMM inputs
    and output gradients (:data:`FP8_CAST_BYTES`); unused in bf16."""
    step: str = "whole"
    """``simulator.step``: ``whole`` or ``moe`` (the MoE-only step: every term of this module is 0)."""
    rl_passes: tuple[str, ...] = ("update",)
    """``workload.rl_passes``: the passes over the batch's tokens, ``update`` always among them."""

    def __post_init__(self) -> None:
        problems = []
        if self.step not in STEPS:
            problems.append(f"simulator.step={self.step!r}: choose one of {', '.join(STEPS)}")
        if self.recompute not in RECOMPUTE:
            problems.append(f"training.recompute={self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")
        problems.extend(self._module_problems())
        if self.cuda_graph not in CUDA_GRAPHS:
            problems.append(
                f"training.cuda_graph={self.cuda_graph!r}: choose one of {', '.join(CUDA_GRAPHS)}"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            problems.append(
                f"training.fp8_recipe={self.fp8_recipe!r}: choose one of {', '.join(FP8_RECIPES)}"
            )
        passes = tuple(self.rl_passes)
        if (
            any(p not in RL_PASSES for p in passes)
            or len(set(passes)) != len(passes)
            or "update" not in passes
        ):
            problems.append(
                f"workload.rl_passes={list(passes)}: a list of distinct passes from {list(RL_PASSES)} that "
                "holds update"
            )
        for name in (
            "norm_values_per_hidden",
            "norm_forward_values_per_hidden",
            "embedding_values_per_hidden",
            "permute_values_per_hidden",
            "swiglu_values_per_ffn",
            "swiglu_forward_values_per_ffn",
            "router_bytes_per_logit",
            "loss_bytes_per_logit",
            "optimizer_bytes_per_param",
            "grad_reduce_bytes_per_param",
            "param_gather_bytes_per_param",
            "host_overhead_s",
        ):
            value = getattr(self, name)
            if name == "host_overhead_s" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                problems.append(f"training.{name}={value!r}: must be a number >= 0")
        for name in ("overlap_grad_reduce", "overlap_param_gather", "distributed_optimizer"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"training.{name}={getattr(self, name)!r}: must be true or false")
        if problems:
            raise ValueError("; ".join(problems))

    def _module_problems(self) -> list[str]:
        """``recompute_modules``: distinct values of :data:`RECOMPUTE_MODULES`, and other than Megatron's
        default only under ``recompute=selective`` (Megatron reads them only there). Stored as a tuple."""
        modules = self.recompute_modules
        if isinstance(modules, str) or not isinstance(modules, list | tuple):
            return [f"training.recompute_modules={modules!r}: must be a list from {list(RECOMPUTE_MODULES)}"]
        object.__setattr__(self, "recompute_modules", tuple(modules))
        listed = list(modules)
        if any(m not in RECOMPUTE_MODULES for m in listed) or len(set(listed)) != len(listed):
            return [
                f"training.recompute_modules={listed}: a list of distinct modules from "
                f"{list(RECOMPUTE_MODULES)}"
            ]
        if self.recompute != "selective" and tuple(listed) != ("core_attn",):
            return [
                f"training.recompute_modules={listed}: Megatron recomputes these modules only with "
                f"training.recompute=selective (got {self.recompute!r})"
            ]
        return []

    @property
    def whole(self) -> bool:
        """Whether the step's terms beyond the MoE-only step are priced (``simulator.step=whole``)."""
        return self.step == "whole"


@dataclass(frozen=True)
class ParallelGroups:
    """The gradient groups of the distributed optimizer around one EP group."""

    dp: int
    """Data-parallel group size of the dense parameters."""
    edp: int
    """Expert-data-parallel group size of the expert parameters (``dp * tp / (ep * etp)`` in Megatron)."""
    dp_nodes: int
    """Nodes the data-parallel group spans (its ring runs on the rail NICs when > 1)."""
    edp_nodes: int
    """Nodes the expert-data-parallel group spans."""


def parallel_groups(
    cluster: ClusterSpec, replicas: int = 1, parallel: ParallelDims | None = None
) -> ParallelGroups:
    """The one definition of the gradient groups around one stage's EP group.

    The simulated EP group is ``G = cluster.nodes * cluster.gpus_per_node`` GPUs and ``replicas``
    (``parallel.dp``, :mod:`relibra.parallel`) copies of the pipeline train side by side on their own
    nodes. Megatron's dense data-parallel group is ``world / (tp * pp) = replicas * G / tp`` ranks, which
    span every node of the stage in every replica; with EP = G each expert lives on one GPU of each
    replica's stage: ``edp = world / (etp * ep * pp) = replicas`` (1: expert gradients need no reduction),
    a group whose ranks sit on ``replicas`` different nodes. ``parallel`` None: ``tp = pp = 1``.
    """
    tp = 1 if parallel is None else parallel.tp
    return ParallelGroups(
        dp=replicas * cluster.num_gpus // tp,
        edp=replicas,
        dp_nodes=replicas * cluster.nodes,
        edp_nodes=replicas,
    )


class WholeStepTerms:
    """The whole step's terms; a base of :class:`~relibra.cost.model.CostModel` (which sets the fields)."""

    cluster: ClusterSpec
    model: ModelSpec
    training: TrainingSpec | None
    migration: MigrationPayload
    """Read for ``expert_data_parallel`` (``parallel.dp``), the replicas the gradient groups span."""
    parallel: ParallelDims
    """The parallel dimensions around the EP group (:mod:`relibra.parallel`)."""

    # ----------------------------------------------------------------- rates
    def _spec(self) -> TrainingSpec:
        if self.training is None:
            raise ValueError("the whole step's terms need a TrainingSpec (CostModel(training=...))")
        return self.training

    def _groups(self) -> ParallelGroups:
        return parallel_groups(self.cluster, self.migration.expert_data_parallel, self.parallel)

    def stage_of_layer(self) -> np.ndarray:
        """int64 [num_layers]: the pipeline stage of each layer, dense layers first (model order; the
        models' dense layers lead, ``first_k_dense_replace``)."""
        return stage_layers(self.model.num_layers, self.parallel)

    def chunk_of_layer(self) -> np.ndarray:
        """int64 [num_layers]: the model chunk (virtual stage) of each layer, model order
        (:func:`relibra.parallel.layer_chunks`)."""
        return layer_chunks(self.model.num_layers, self.parallel)

    def stage_layer_counts(self, stage: int) -> tuple[int, int]:
        """(dense, MoE) layers pipeline stage ``stage`` holds."""
        m = self.model
        on = self.stage_of_layer() == stage
        dense_layers = m.num_layers - m.num_moe_layers
        return int(on[:dense_layers].sum()), int(on[dense_layers:].sum())

    def stage_parameters(self, stage: int = 0) -> tuple[float, float]:
        """(dense, expert) parameters held by one GPU of pipeline stage ``stage``, unsharded by the optimizer.

        Dense: the tensor-parallel ones (attention projections, shared experts, dense FFNs, the input
        embedding on stage 0 and the LM head on the last stage) over ``tp``, the replicated ones (norms,
        routers, the final norm on the last stage) whole, as Megatron shards them
        (``megatron/training/theoretical_memory_usage.py``). Expert: ``E / G`` experts of each MoE layer.
        With every parallel size 1 these are :attr:`ModelSpec.dense_params` and every MoE layer's experts.
        """
        m, par = self.model, self.parallel
        nd, nm = self.stage_layer_counts(stage)
        first, last = stage == 0, stage == par.pp - 1
        sharded = (
            m.attention_params * (nd + nm)
            + 3 * m.hidden * m.shared_ffn * m.shared_experts * nm
            + 3 * m.hidden * m.dense_ffn * nd
            + m.vocab * m.hidden * (int(first) + int(last))
        )
        replicated = 2 * m.hidden * (nd + nm) + m.hidden * int(last) + m.hidden * m.num_experts * nm
        dense = float(sharded + replicated) if par.tp == 1 else sharded / par.tp + replicated
        expert = float(nm * m.num_experts // self.cluster.num_gpus * m.expert_params)
        return dense, expert

    def hbm_rate(self) -> float:
        """Bytes/s of a streaming kernel: ``hbm_bytes_per_s * hbm_efficiency``."""
        hw = self.cluster.hardware
        if hw.hbm_efficiency <= 0:
            raise ValueError(
                f"cluster.hardware.hbm_efficiency={hw.hbm_efficiency}: the whole step's memory-bound terms "
                "need it > 0 (set it in the cluster yaml, or simulator.step=moe)"
            )
        return hw.hbm_bytes_per_s * hw.hbm_efficiency

    def dense_rate(self, precision: str | None = None) -> float:
        """FLOP/s of a dense GEMM in ``precision`` (default ``cluster.precision``), at
        ``attention_efficiency``."""
        hw = self.cluster.hardware
        fp8 = (precision or self.cluster.precision) == "fp8"
        return (hw.fp8_flops if fp8 else hw.bf16_flops) * hw.attention_efficiency

    # ------------------------------------------------------- per-GPU terms
    def head_time(self, tokens: np.ndarray) -> np.ndarray:
        """Embedding, LM head and loss seconds, fwd + bwd: tokens [..., G] -> [..., G]."""
        spec, m = self._spec(), self.model
        t = np.asarray(tokens, dtype=np.float64)
        gemm = 3.0 * 2.0 * m.hidden * m.vocab * t / self.dense_rate("bf16")
        loss = t * m.vocab * spec.loss_bytes_per_logit / self.hbm_rate()
        embed = t * m.hidden * spec.embedding_values_per_hidden * BF16_BYTES / self.hbm_rate()
        return np.asarray(gemm + loss + embed)

    def head_forward_time(self, tokens: np.ndarray) -> np.ndarray:
        """The forward share of :meth:`head_time` (log-probabilities of a forward-only pass) [..., G]."""
        spec, m = self._spec(), self.model
        t = np.asarray(tokens, dtype=np.float64)
        gemm = 2.0 * m.hidden * m.vocab * t / self.dense_rate("bf16")
        mem = t * (
            m.vocab * spec.loss_bytes_per_logit + m.hidden * spec.embedding_values_per_hidden * BF16_BYTES
        )
        return np.asarray(gemm + FORWARD_BYTES_SHARE * mem / self.hbm_rate())

    def router_time(self, tokens: np.ndarray) -> np.ndarray:
        """One MoE layer's router seconds (GEMM, scores, top-k), fwd + bwd: tokens [..., G] -> [..., G]."""
        spec, m = self._spec(), self.model
        t = np.asarray(tokens, dtype=np.float64)
        gemm = 3.0 * 2.0 * m.hidden * m.num_experts * t / self.dense_rate("bf16")
        return np.asarray(gemm + t * m.num_experts * spec.router_bytes_per_logit / self.hbm_rate())

    def norm_time(self, tokens: np.ndarray) -> np.ndarray:
        """One layer's norms and residual adds, fwd + bwd: tokens [..., G] -> seconds [..., G]."""
        spec, m = self._spec(), self.model
        t = np.asarray(tokens, dtype=np.float64)
        return np.asarray(t * m.hidden * spec.norm_values_per_hidden * BF16_BYTES / self.hbm_rate())

    def norm_forward_time(self, tokens: np.ndarray) -> np.ndarray:
        """One RMSNorm's forward (what ``layernorm`` recompute repeats): tokens [..., G] -> seconds."""
        spec, m = self._spec(), self.model
        t = np.asarray(tokens, dtype=np.float64)
        return np.asarray(t * m.hidden * spec.norm_forward_values_per_hidden * BF16_BYTES / self.hbm_rate())

    def activation_share(self) -> float:
        """The share of :meth:`permute_time` that SwiGLU's forward moves (what ``moe_act`` recompute
        repeats): both follow the received slots at the same rate, so it is a ratio of value counts."""
        spec, m = self._spec(), self.model
        values = m.hidden * spec.permute_values_per_hidden + m.moe_ffn * spec.swiglu_values_per_ffn
        return m.moe_ffn * spec.swiglu_forward_values_per_ffn / values if values > 0 else 0.0

    def permute_time(self, received: np.ndarray) -> np.ndarray:
        """One MoE layer's permutation, un-permutation and SwiGLU on the received slots, fwd + bwd.

        received [..., G] (``sum_e assign[..., e, g]``) -> seconds [..., G].
        """
        spec, m = self._spec(), self.model
        r = np.asarray(received, dtype=np.float64)
        values = m.hidden * spec.permute_values_per_hidden + m.moe_ffn * spec.swiglu_values_per_ffn
        return np.asarray(r * values * BF16_BYTES / self.hbm_rate())

    def _cast_seconds_per_value(self) -> float:
        """Seconds per value cast to FP8 (0 in bf16: nothing is cast)."""
        if self.cluster.precision != "fp8":
            return 0.0
        return FP8_CAST_BYTES[self._spec().fp8_recipe] / self.hbm_rate()

    def expert_cast_time(self, received: np.ndarray) -> np.ndarray:
        """One MoE layer's FP8 casts for the expert grouped GEMMs on the received slots, fwd + bwd.

        Per slot the two GEMMs' inputs (``hidden`` for the gate-and-up projection, ``moe_ffn`` for the
        down projection) and their output gradients (``hidden``, ``2 * moe_ffn``): ``2 h + 3 f`` values.
        received [..., G] -> seconds [..., G]; 0 in bf16. The weights' casts (once per step: Transformer
        Engine keeps them across micro-batches, ``is_first_microbatch``) are not priced.
        """
        m = self.model
        r = np.asarray(received, dtype=np.float64)
        return np.asarray(r * (2 * m.hidden + 3 * m.moe_ffn) * self._cast_seconds_per_value())

    def dense_cast_time(self, tokens: np.ndarray, moe_layer: bool = True) -> np.ndarray:
        """One layer's FP8 casts for its dense GEMMs on the tokens each GPU holds, fwd + bwd: tokens [..., G]
        -> seconds [..., G]; 0 in bf16.

        Each GEMM casts its input and its output gradient: each attention projection its input and output
        widths (:meth:`~relibra.cluster.ModelSpec.attention_gemms`; grouped-query: the QKV projection ``h``
        and ``q + 2 kv``, the output projection ``q`` and ``h``); then a MoE layer's shared experts (``2 h +
        3 s``, ``s`` their FFN width summed) or a dense layer's FFN (``2 h + 3 dense_ffn``).
        """
        m = self.model
        ffn = m.shared_ffn * m.shared_experts if moe_layer else m.dense_ffn
        attention = sum(i + o for i, o in m.attention_gemms())
        values = attention + (2 * m.hidden + 3 * ffn if ffn > 0 else 0)
        t = np.asarray(tokens, dtype=np.float64)
        return np.asarray(t * values * self._cast_seconds_per_value())

    def shared_cast_time(self, tokens: np.ndarray) -> np.ndarray:
        """One MoE layer's FP8 casts for its shared experts' GEMMs alone (the share of
        :meth:`dense_cast_time` that is not attention's), fwd + bwd: tokens [..., G] -> seconds; 0 in bf16 or
        without shared experts."""
        m = self.model
        ffn = m.shared_ffn * m.shared_experts
        values = 2 * m.hidden + 3 * ffn if ffn > 0 else 0
        return np.asarray(np.asarray(tokens, dtype=np.float64) * values * self._cast_seconds_per_value())

    def core_attention_time(self, causal_pairs: np.ndarray) -> np.ndarray:
        """QK^T and PV of one layer (bf16, at ``attention_efficiency``), fwd + bwd: causal pairs [..., G] ->
        seconds [..., G]."""
        flops = self.model.core_attention_flops(causal_pairs)
        return np.asarray(3.0 * flops / self.dense_rate("bf16"))

    # ------------------------------------------------------ per-step terms
    def params_per_gpu(self, stage: int = 0) -> tuple[float, float]:
        """(dense, expert) parameters one GPU of ``stage`` updates (:meth:`stage_parameters`): dense ones
        sharded over the data-parallel group and expert ones over the expert-data-parallel group with the
        distributed optimizer; unsharded without it."""
        spec, groups = self._spec(), self._groups()
        dense, expert = self.stage_parameters(stage)
        if spec.distributed_optimizer:
            return dense / groups.dp, expert / groups.edp
        return dense, expert

    def optimizer_time(self, stage: int = 0) -> float:
        """Seconds of one Adam step over the parameters this GPU updates (HBM-bound)."""
        dense, expert = self.params_per_gpu(stage)
        return (dense + expert) * self._spec().optimizer_bytes_per_param / self.hbm_rate()

    def _ring_time(self, nbytes: float, size: int, nodes: int) -> float:
        """One ring reduce-scatter or all-gather of ``nbytes`` (the whole buffer) over ``size`` GPUs."""
        if size <= 1 or nbytes <= 0:
            return 0.0
        hw = self.cluster.hardware
        rate = (
            hw.nic_bytes_per_s * hw.nic_efficiency
            if nodes > 1
            else hw.nvlink_bytes_per_s * hw.nvlink_efficiency
        )
        return (size - 1) / size * nbytes / rate + hw.alltoall_latency_s

    def grad_reduce_time(self, stage: int = 0) -> float:
        """Seconds of the gradient reduction, dense (data-parallel group) plus expert (expert-data-parallel
        group) parameters: a reduce-scatter with the distributed optimizer, else an all-reduce (twice its
        traffic). Before any overlap."""
        spec, groups = self._spec(), self._groups()
        factor = 1.0 if spec.distributed_optimizer else 2.0
        dense, expert_full = self.stage_parameters(stage)
        b = spec.grad_reduce_bytes_per_param
        return factor * (
            self._ring_time(dense * b, groups.dp, groups.dp_nodes)
            + self._ring_time(expert_full * b, groups.edp, groups.edp_nodes)
        )

    def param_gather_time(self, stage: int = 0) -> float:
        """Seconds of the distributed optimizer's parameter all-gather (0 without it). Before any overlap."""
        spec, groups = self._spec(), self._groups()
        if not spec.distributed_optimizer:
            return 0.0
        dense, expert_full = self.stage_parameters(stage)
        b = spec.param_gather_bytes_per_param
        return self._ring_time(dense * b, groups.dp, groups.dp_nodes) + self._ring_time(
            expert_full * b, groups.edp, groups.edp_nodes
        )

    def launch_time(self, microbatches: int, directions: float) -> float:
        """Exposed host seconds of ``microbatches`` micro-batches, ``directions`` passes each (forward 1,
        backward 1, recompute 1) over every MoE layer; 0 under a full-iteration CUDA graph (nothing is
        launched from the host)."""
        spec = self._spec()
        if spec.cuda_graph == "full_iteration":
            return 0.0
        return self.host_overhead() * self.model.num_moe_layers * microbatches * directions

    def host_overhead(self) -> float:
        """Exposed host seconds per MoE layer, pass direction and micro-batch: ``training.host_overhead_s``
        when set, else the GPU generation's calibrated ``cluster.hardware.host_overhead_s``."""
        own = self._spec().host_overhead_s
        return float(self.cluster.hardware.host_overhead_s if own is None else own)
