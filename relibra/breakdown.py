"""The result columns of a simulated run as one typed record (docs/spine.md, "Result columns").

:class:`StepBreakdown`'s field names are the columns :func:`relibra.simulator.simulate` emits for every run,
in the order it emits them; :data:`METRIC_COLUMNS` is derived from its fields, so a column cannot be emitted
without being listed. Every value is per step (batch), the mean over the run's batches, unless its line says
otherwise; ``*_s`` columns are seconds, ``*_bytes`` bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["METRIC_COLUMNS", "WHOLE_STEP_COLUMNS", "StepBreakdown"]


@dataclass(frozen=True)
class StepBreakdown:
    """One run's result columns (scalars; docs/spine.md, "Result columns", one line each)."""

    step_time_s: float
    """Simulated seconds per step: ``t_pass_update_s + t_pass_recompute_s + t_pass_reference_s``."""
    throughput_tokens_per_s: float
    """All tokens over all simulated seconds (tokens/s)."""
    skew_mean: float
    """Mean skewness ``max_g / mean_g`` of per-GPU compute tokens over every (micro-batch, layer)."""
    skew_p50: float
    """Median skewness."""
    skew_p90: float
    """90th-percentile skewness."""
    skew_max: float
    """Largest skewness."""
    plan_time_s: float
    """Planner wall-clock seconds per batch."""
    replica_buffer_bytes: float
    """The layer-shared replica buffer: most slots used (at least the budget's) x one expert's bf16 bytes."""
    reorder_moved_experts: float
    """(layer, expert) pairs whose home changed, per batch."""
    migration_bytes: float
    """Bytes the EP group sends between GPUs to re-home them, per batch."""
    layers_kept_share: float
    """Share of (batch, layer) pairs whose placement did not change (all batches, not a mean)."""
    layers_kept_share_min: float
    """The same share for the layer that kept its placement least often."""
    t_compute_s: float
    """Sum over micro-batches and MoE layers of ``max_g T_comp``."""
    t_comm_s: float
    """Sum over micro-batches and MoE layers of ``max_g T_comm``."""
    t_comm_exposed_s: float
    """The part of ``t_comm_s`` on the critical path (all of it without ``cluster.ep_overlap``)."""
    t_comm_hidden_s: float
    """The part of ``t_comm_s`` hidden behind other compute (``t_comm_s - t_comm_exposed_s``)."""
    t_sync_exposed_s: float
    """Exposed per-layer weight transfers (replica fill, gradient return, online copies), redundant sync."""
    t_reorder_s: float
    """Migration seconds beyond the post-rollout window (``simulator.migration.window_s``)."""
    t_reorder_hidden_s: float
    """Migration seconds hidden in the post-rollout window."""
    t_attention_s: float
    """Attention (and shared experts) of every MoE layer and micro-batch plus the whole dense layers."""
    t_critical_path_s: float
    """An online planner's planning between a layer's routing and its expert compute."""
    redundant_slot_bytes: float
    """Permanent redundant slots: most slots per GPU x MoE layers x one expert's bf16 bytes (run total)."""
    t_head_s: float
    """Embedding, LM head and loss (``simulator.step=whole``; 0 otherwise, as every whole-step column)."""
    t_router_s: float
    """Every MoE layer's router."""
    t_permute_s: float
    """Permutation, un-permutation and SwiGLU on the slots each GPU receives."""
    t_fp8_cast_s: float
    """FP8 casts of the expert and dense GEMMs (0 in bf16)."""
    t_norm_s: float
    """Every layer's norms and residual adds."""
    t_recompute_s: float
    """Activation recompute (``training.recompute``) in the backward pass."""
    t_launch_s: float
    """Host overhead per MoE layer, pass and micro-batch."""
    t_optimizer_s: float
    """The optimizer step over the parameters a GPU updates."""
    t_grad_reduce_s: float
    """Exposed part of the distributed optimizer's gradient reduce-scatter."""
    t_param_gather_s: float
    """Exposed part of the distributed optimizer's parameter all-gather."""
    t_other_s: float
    """The balance-independent part of the update (head, router, norms, host overhead, optimizer, reduce)."""
    t_pass_update_s: float
    """The policy update pass."""
    t_pass_recompute_s: float
    """The RL step's forward-only recompute pass (0 when ``workload.rl_passes`` lacks it)."""
    t_pass_reference_s: float
    """The reference model's forward-only pass (0 when ``workload.rl_passes`` lacks it)."""
    t_bubble_s: float
    """The slowest pipeline stage's 1F1B bubble (0 without ``parallel.pp``)."""
    t_p2p_s: float
    """The pipeline's stage-to-stage sends (0 without ``parallel.pp``)."""
    t_tp_comm_s: float
    """Tensor parallelism's exposed collectives over every layer (0 without ``parallel.tp``)."""

    def columns(self) -> dict[str, float]:
        """The record as result columns, in :data:`METRIC_COLUMNS` order."""
        return asdict(self)


METRIC_COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(StepBreakdown))
"""The result columns of every run (:class:`StepBreakdown`'s fields, in order)."""
WHOLE_STEP_COLUMNS: tuple[str, ...] = METRIC_COLUMNS[METRIC_COLUMNS.index("t_head_s") :]
"""The whole step's and the parallel dimensions' columns (:mod:`relibra.cost.passes`,
:mod:`relibra.cost.pipeline`, :mod:`relibra.cost.tensor`): 0 where ``simulator.step=moe``, the pass is not run
or the parallel dimensions are trivial."""
