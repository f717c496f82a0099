"""How the terms of one batch join into its seconds: the policy update (forward, backward, optimizer) and the
RL step's forward-only passes over the same tokens (``workload.rl_passes``), each a result column.

Per (micro-batch, MoE layer) the busiest GPU's compute work is ``T_comp + attention + permutation +
router + norms`` and its communication ``T_comm``; both join as ``cluster.ep_overlap`` says
(:func:`relibra.cost.overlap.overlapped_time`, or their sums). Activation recompute (``training.recompute``)
adds, in the update's backward, the forwards of ``training.recompute_modules`` (``selective``:
:mod:`relibra.cost.recompute`; the MoE layer's all-to-all only with ``moe``) or every layer's forward,
its all-to-all included (``full``). Per batch the update adds the dense layers, the LM head, the exposed
replica refill, migration, redundant-copy sync, an online planner's critical path, the host overhead, the
optimizer step and the exposed parts of the distributed optimizer's gradient reduce-scatter (behind the
last micro-batch's backward with ``overlap_grad_reduce``) and parameter all-gather (behind the first
micro-batch's forward with ``overlap_param_gather``). Those windows are the passes' wall time: the GPU's
work and the host time the GPU waits for (:func:`_exposed_collectives`), since a collective already queued
runs while the GPU waits for the host's next launch.

A forward-only pass (``recompute``: the old policy's log-probabilities under the same replayed routing,
priced with the method's own plan; ``reference``: the reference model's forward, priced on Megatron's
static placement, since no method balances the reference model and its routing is not replayed) does a
third of each GEMM's fwd + bwd seconds (:data:`relibra.cost.step.FORWARD_FLOPS_SHARE`), half of each
memory-bound kernel's (:data:`~relibra.cost.step.FORWARD_BYTES_SHARE`) and the dispatch and combine
forward (half of the four phases, latency included).

With ``simulator.step=moe`` every term of :mod:`relibra.cost.step` is zero and the update's seconds are
the MoE-only step's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relibra.cost.context import cp_exchange_time
from relibra.cost.model import CostModel
from relibra.cost.overlap import overlapped_time
from relibra.cost.pipeline import StagePass, p2p_send_time, pipelined
from relibra.cost.recompute import selective_recompute
from relibra.cost.step import FORWARD_BYTES_SHARE, FORWARD_FLOPS_SHARE, TrainingSpec
from relibra.cost.tensor import tp_block_time, tp_group_mean
from relibra.cost.work import LayerWork, TokenWork

__all__ = ["LayerWork", "PassTimes", "TokenWork", "forward_pass", "token_work", "update_pass"]


def _casts(cost: CostModel, tokens: np.ndarray, tp: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(``cast_moe``, ``cast_dense``) of :class:`TokenWork` [Mb]: the busiest tensor-parallel group's
    dense FP8 casts (split ``tp`` ways as its GEMMs are), or (None, None) when nothing is cast."""
    spec = cost.training
    if spec is None or not spec.whole or cost.cluster.precision != "fp8":
        return None, None
    moe = tp_group_mean(cost.dense_cast_time(tokens, moe_layer=True), tp).max(axis=-1)
    dense = tp_group_mean(cost.dense_cast_time(tokens, moe_layer=False), tp).max(axis=-1)
    return moe, dense


def token_work(cost: CostModel, tokens: np.ndarray, pairs: np.ndarray) -> TokenWork:
    """:class:`TokenWork` from the tokens [Mb, G] and causal pairs [Mb, G] each GPU holds."""
    if not cost.parallel.trivial:
        return _parallel_token_work(cost, tokens, pairs)
    attn_gpu = cost.attention_time(tokens, pairs)  # [Mb, G]
    dense = (attn_gpu + cost.dense_ffn_time(tokens)).max(axis=-1)
    cast_moe, cast_dense = _casts(cost, tokens, 1)
    mb = attn_gpu.shape[0]
    if cost.training is None or not cost.training.whole:
        zero = np.zeros(mb)
        return TokenWork(attn_gpu.max(axis=-1)[:, None], zero, dense, zero, zero, zero, zero)
    return TokenWork(
        attn=attn_gpu.max(axis=-1)[:, None],
        core_attn=cost.core_attention_time(pairs).max(axis=-1),
        dense=dense,
        router=cost.router_time(tokens).max(axis=-1),
        norm=cost.norm_time(tokens).max(axis=-1),
        head=cost.head_time(tokens).max(axis=-1),
        head_forward=cost.head_forward_time(tokens).max(axis=-1),
        cast_moe=cast_moe,
        cast_dense=cast_dense,
        norm_forward=cost.norm_forward_time(tokens).max(axis=-1),
        shared=cost.shared_expert_time(tokens).max(axis=-1),
        dense_ffn=cost.dense_ffn_time(tokens).max(axis=-1),
        mla_up=cost.mla_up_time(tokens).max(axis=-1),
    )


def _parallel_token_work(cost: CostModel, tokens: np.ndarray, pairs: np.ndarray) -> TokenWork:
    """:func:`token_work` under tensor, context or pipeline parallelism: the split GEMMs at their
    tensor-parallel group's mean (:func:`relibra.cost.tensor.tp_group_mean`), routers and norms on each GPU's
    own (sequence-parallel) tokens, the tensor-parallel collectives, the context-parallel key-value ring's
    exposed seconds in every layer's attention (:func:`relibra.cost.context.cp_exchange_time`) and the
    pipeline sends."""
    tp = cost.parallel.tp
    attn_gpu = tp_group_mean(cost.attention_time(tokens, pairs), tp)  # [Mb, G / tp]
    core = cost.core_attention_time(pairs)  # [Mb, G]
    # NOTE: context parallelism's exposed key-value ring joins every attention layer (relibra.cost.context).
    ring = (
        cp_exchange_time(cost.cluster, cost.model, cost.parallel, tokens, core)
        if cost.parallel.cp > 1
        else 0.0
    )
    dense = (attn_gpu + tp_group_mean(cost.dense_ffn_time(tokens), tp)).max(axis=-1) + ring
    mb = attn_gpu.shape[0]
    tp_block = tp_block_time(cost.cluster, cost.model, tp, tokens) if tp > 1 else None
    p2p = p2p_send_time(cost, tokens) if cost.parallel.pp > 1 else None
    cast_moe, cast_dense = _casts(cost, tokens, tp)
    attn = (attn_gpu.max(axis=-1) + ring)[:, None]
    if cost.training is None or not cost.training.whole:
        zero = np.zeros(mb)
        return TokenWork(attn, zero, dense, zero, zero, zero, zero, tp_block, p2p)
    return TokenWork(
        attn=attn,
        core_attn=tp_group_mean(core, tp).max(axis=-1) + ring,
        dense=dense,
        router=cost.router_time(tokens).max(axis=-1),
        norm=cost.norm_time(tokens).max(axis=-1),
        head=tp_group_mean(cost.head_time(tokens), tp).max(axis=-1),
        head_forward=tp_group_mean(cost.head_forward_time(tokens), tp).max(axis=-1),
        tp_block=tp_block,
        p2p=p2p,
        cast_moe=cast_moe,
        cast_dense=cast_dense,
        norm_forward=cost.norm_forward_time(tokens).max(axis=-1),
        shared=tp_group_mean(cost.shared_expert_time(tokens), tp).max(axis=-1),
        dense_ffn=tp_group_mean(cost.dense_ffn_time(tokens), tp).max(axis=-1),
        mla_up=tp_group_mean(cost.mla_up_time(tokens), tp).max(axis=-1),
    )


@dataclass(frozen=True)
class PassTimes:
    """One pass's seconds and the named parts it reports (result columns, per batch)."""

    total: float
    comm_exposed: float
    """All-to-all seconds not hidden behind compute."""
    parts: dict[str, float]


def _join(comp: np.ndarray, comm: np.ndarray, cost: CostModel) -> tuple[float, float]:
    """(seconds, exposed all-to-all seconds) of the MoE layers' compute and comm [Mb, L]."""
    if cost.cluster.ep_overlap:
        return overlapped_time(comp, comm, cost.cluster.comm_sm_share)
    total_comm = float(comm.sum())
    return float(comp.sum()) + total_comm, total_comm


def update_pass(
    cost: CostModel,
    work: LayerWork,
    tw: TokenWork,
    dense_layers: int,
    fixed: tuple[float, float, float, float],
) -> PassTimes:
    """The policy update: forward + backward of every micro-batch, then the optimizer step.

    ``fixed``: the batch's seconds priced elsewhere that join as they are: (exposed refill, migration,
    redundant-copy sync, critical path) (:func:`relibra.cost.pricing.batch_times`).
    """
    spec = cost.training
    whole = spec is not None and spec.whole
    recompute = spec.recompute if (spec is not None and whole) else "none"
    layer_tokens = tw.router[:, None] + tw.norm[:, None]  # [Mb, 1]
    if tw.tp_block is not None:  # the attention block's (and the shared experts') collectives
        layer_tokens = layer_tokens + _moe_tp_blocks(cost) * tw.tp_block[:, None]
    comp = work.compute + tw.attn + work.permute + layer_tokens  # [Mb, L]
    comp, dense_cast = _with_casts(comp, work, tw)
    comm = work.comm
    dense_mb = tw.dense + tw.norm + dense_cast  # [Mb]: one dense layer
    if recompute == "full":
        rc_comp, rc_comm = comp * FORWARD_FLOPS_SHARE, comm * 0.5
        rc_dense = dense_layers * float(dense_mb.sum()) * FORWARD_FLOPS_SHARE
        sel_dense = None
    elif recompute == "selective":
        sel = selective_recompute(cost, work, tw)
        rc_comp, rc_comm, sel_dense = sel.moe, sel.comm, sel.dense
        rc_dense = dense_layers * float(sel.dense.sum())
    else:
        rc_comp, rc_comm, rc_dense, sel_dense = np.zeros_like(comp), np.zeros_like(comm), 0.0, None
    comp_u, comm_u = comp + rc_comp, comm + rc_comm
    if not cost.parallel.trivial:
        return _parallel_update(
            cost, work, tw, dense_layers, fixed, (comp_u, comm_u, rc_comp + rc_comm), sel_dense
        )
    moe, exposed = _join(comp_u, comm_u, cost)
    if recompute != "none" and exposed > 0:
        # NOTE: the exposed all-to-all is attributed to the update's own and the recomputed all-to-all in
        # proportion, so t_comm_exposed_s stays a part of t_comm_s (the recompute's is in t_recompute_s).
        exposed *= float(comm.sum()) / float(comm_u.sum())
    dense = dense_layers * float(tw.dense.sum())
    head = float(tw.head.sum())
    parts = dict.fromkeys(_UPDATE_PARTS, 0.0)
    if whole:
        assert spec is not None
        directions = _directions(spec)
        per_mb = comp_u.sum(axis=1) + comm_u.sum(axis=1) + dense_layers * dense_mb + tw.head  # [Mb]
        grad_reduce, param_gather = _exposed_collectives(
            cost, spec, 0, float(per_mb[0]), float(per_mb[-1]), 1.0
        )
        parts.update(
            t_head_s=head,
            t_router_s=float(tw.router.sum()) * work.compute.shape[1],
            t_norm_s=float(tw.norm.sum()) * (work.compute.shape[1] + dense_layers),
            t_permute_s=float(work.permute.sum()),
            t_fp8_cast_s=_cast_total(work, tw, dense_layers),
            t_recompute_s=float(rc_comp.sum() + rc_comm.sum()) + rc_dense,
            t_launch_s=cost.launch_time(comp.shape[0], directions),
            t_optimizer_s=cost.optimizer_time(),
            t_grad_reduce_s=grad_reduce,
            t_param_gather_s=param_gather,
        )
    # NOTE: the MoE-only step's sum first, in its former order, so simulator.step=moe keeps its bits.
    sync, migration, redundant, critical = fixed
    total = moe + sync + dense + migration + redundant + critical
    extra = (
        dense_layers * float((tw.norm + dense_cast).sum())
        + rc_dense
        + head
        + parts["t_launch_s"]
        + parts["t_optimizer_s"]
        + parts["t_grad_reduce_s"]
        + parts["t_param_gather_s"]
    )
    if whole:
        total += extra
    parts["t_other_s"] = sum(parts[k] for k in _BALANCE_INDEPENDENT)
    parts.update(dict.fromkeys(_PARALLEL_PARTS, 0.0))
    return PassTimes(total=total, comm_exposed=exposed, parts=parts)


def _with_casts(
    comp: np.ndarray, work: LayerWork, tw: TokenWork, share: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The MoE layers' compute ``comp`` [Mb, L] with ``share`` of their FP8 casts (expert and dense GEMMs;
    a forward-only pass: :data:`~relibra.cost.step.FORWARD_BYTES_SHARE`), and that share of one dense
    layer's casts [Mb]; ``comp`` unchanged (its bits kept) and zeros when nothing is cast."""
    if work.cast is not None:
        comp = comp + work.cast * share
    if tw.cast_moe is not None:
        comp = comp + tw.cast_moe[:, None] * share
    return comp, _dense_casts(tw, share)


def _dense_casts(tw: TokenWork, share: float) -> np.ndarray:
    """``share`` of one dense layer's FP8 casts [Mb] (zeros when nothing is cast)."""
    return np.zeros_like(tw.dense) if tw.cast_dense is None else tw.cast_dense * share


def _cast_total(work: LayerWork, tw: TokenWork, dense_layers: int) -> float:
    """The pass's FP8 cast seconds (``t_fp8_cast_s``): every MoE layer's expert and dense casts, and the
    dense layers'."""
    total = 0.0 if work.cast is None else float(work.cast.sum())
    if tw.cast_moe is not None:
        total += float(tw.cast_moe.sum()) * work.compute.shape[1]
    if tw.cast_dense is not None:
        total += float(tw.cast_dense.sum()) * dense_layers
    return total


def _moe_tp_blocks(cost: CostModel) -> int:
    """Tensor-parallel blocks of a MoE layer: attention, and the shared experts if the model has any."""
    return 1 + int(cost.model.shared_experts > 0)


def _exposed_collectives(
    cost: CostModel, spec: TrainingSpec, stage: int, first_mb: float, last_mb: float, share: float
) -> tuple[float, float]:
    """Seconds of the gradient reduce-scatter and the parameter all-gather of ``stage`` left exposed.

    With ``overlap_grad_reduce`` the reduce-scatter hides behind the last micro-batch's backward (two thirds
    of its GPU seconds ``last_mb``, fwd + bwd), with ``overlap_param_gather`` the all-gather behind the first
    micro-batch's forward (a third of ``first_mb``), as Megatron's bucketed overlap does; each window also
    holds the host time of its directions (the forward's one, the backward's and any recompute's the rest)
    over the stage's ``share`` of the MoE layers, during which the GPU waits and the collective runs.
    """
    rs, ag = cost.grad_reduce_time(stage), cost.param_gather_time(stage)
    directions = _directions(spec)
    backward_host = share * cost.launch_time(1, directions - 1.0)
    forward_host = share * cost.launch_time(1, 1.0)
    return (
        max(rs - (2.0 * last_mb / 3.0 + backward_host), 0.0) if spec.overlap_grad_reduce else rs,
        max(ag - (first_mb / 3.0 + forward_host), 0.0) if spec.overlap_param_gather else ag,
    )


def _directions(spec: TrainingSpec) -> float:
    """Pass directions that launch every MoE layer's kernels: forward, backward, and a third where the
    backward recomputes the layer's forward (``full``, or ``selective`` with ``moe``)."""
    again = spec.recompute == "full" or (spec.recompute == "selective" and "moe" in spec.recompute_modules)
    return 3.0 if again else 2.0


def _dense_recompute(spec_recompute: str, dense_mb: np.ndarray, sel_dense: np.ndarray | None) -> np.ndarray:
    """float64 [Mb]: one dense layer's recompute seconds in the update's backward (``sel_dense``: the
    selective modules', :class:`relibra.cost.recompute.SelectiveRecompute`)."""
    if spec_recompute == "full":
        return dense_mb * FORWARD_FLOPS_SHARE
    if spec_recompute == "selective" and sel_dense is not None:
        return sel_dense
    return np.zeros_like(dense_mb)


def _parallel_update(
    cost: CostModel,
    work: LayerWork,
    tw: TokenWork,
    dense_layers: int,
    fixed: tuple[float, float, float, float],
    moe_work: tuple[np.ndarray, np.ndarray, np.ndarray],
    sel_dense: np.ndarray | None,
) -> PassTimes:
    """:func:`update_pass` through the pipeline and with tensor parallelism (:mod:`relibra.cost.pipeline`,
    :mod:`relibra.cost.tensor`). ``moe_work``: ``comp_u``, ``comm_u`` [Mb, L], the MoE layers' seconds with
    their recompute (``rc_moe`` [Mb, L]) and tensor-parallel collectives; ``sel_dense`` [Mb]: one dense
    layer's selective recompute (None unless ``selective``).

    Per-layer parts sum every stage's layers (the model's work); the exposed gradient collectives, the
    bubble and the pipeline sends are the slowest stage's, the optimizer step the longest stage's.
    """
    spec = cost.training
    whole = spec is not None and spec.whole
    recompute = spec.recompute if (spec is not None and whole) else "none"
    comp_u, comm_u, rc_moe = moe_work
    par = cost.parallel
    tp_block = tw.tp_block if tw.tp_block is not None else np.zeros_like(tw.dense)
    p2p = tw.p2p if tw.p2p is not None else np.zeros_like(tw.dense)
    dense_mb = tw.dense + tw.norm + 2.0 * tp_block  # [Mb]: one dense layer (attention and FFN blocks)
    if tw.cast_dense is not None:
        dense_mb = dense_mb + tw.cast_dense
    rc_dense = _dense_recompute(recompute, dense_mb, sel_dense)
    head = (tw.head + tp_block) if whole else np.zeros_like(tw.dense)
    launch = cost.launch_time(comp_u.shape[0], _directions(spec)) if (whole and spec is not None) else 0.0
    sp = StagePass(
        comp=comp_u,
        comm=comm_u,
        dense=(dense_mb if whole else tw.dense + 2.0 * tp_block) + rc_dense,
        head=head,
        p2p=2.0 * par.vpp * p2p,
        spread=sum(fixed) + launch,
        overlap=cost.cluster.ep_overlap,
        contention=cost.cluster.comm_sm_share,
    )

    def per_step(stage: int, first_mb: float, last_mb: float, share: float) -> tuple[float, ...]:
        assert spec is not None
        return (
            cost.optimizer_time(stage),
            *_exposed_collectives(cost, spec, stage, first_mb, last_mb, share),
        )

    st = pipelined(cost.chunk_of_layer(), dense_layers, par.pp, par.vpp, sp, per_step if whole else None)
    comm = work.comm
    exposed = st.comm_exposed
    if recompute != "none" and exposed > 0:
        exposed *= float(comm.sum()) / float(comm_u.sum())  # NOTE: as update_pass
    parts = dict.fromkeys(_UPDATE_PARTS, 0.0)
    num_moe = work.compute.shape[1]
    if whole:
        _, grad_reduce, param_gather = st.per_step
        parts.update(
            t_head_s=float(head.sum()),
            t_router_s=float(tw.router.sum()) * num_moe,
            t_norm_s=float(tw.norm.sum()) * (num_moe + dense_layers),
            t_permute_s=float(work.permute.sum()),
            t_fp8_cast_s=_cast_total(work, tw, dense_layers),
            t_recompute_s=float(rc_moe.sum()) + dense_layers * float(rc_dense.sum()),
            t_launch_s=launch,
            # NOTE: every stage's optimizer runs at once; the longest is plan-independent.
            t_optimizer_s=max(cost.optimizer_time(s) for s in range(par.pp)),
            t_grad_reduce_s=grad_reduce,
            t_param_gather_s=param_gather,
        )
    parts["t_other_s"] = sum(parts[k] for k in _BALANCE_INDEPENDENT)
    parts.update(
        t_bubble_s=st.bubble,
        t_p2p_s=st.p2p,
        t_tp_comm_s=float(tp_block.sum()) * (_moe_tp_blocks(cost) * num_moe + 2 * dense_layers + int(whole)),
    )
    return PassTimes(total=st.total, comm_exposed=exposed, parts=parts)


_PARALLEL_PARTS = ("t_bubble_s", "t_p2p_s", "t_tp_comm_s")
"""The parallel dimensions' parts (0 without tensor or pipeline parallelism): the slowest stage's bubble and
pipeline sends, and the tensor-parallel collectives of every layer."""


_UPDATE_PARTS = (
    "t_head_s",
    "t_router_s",
    "t_norm_s",
    "t_permute_s",
    "t_fp8_cast_s",
    "t_recompute_s",
    "t_launch_s",
    "t_optimizer_s",
    "t_grad_reduce_s",
    "t_param_gather_s",
)
_BALANCE_INDEPENDENT = (
    "t_head_s",
    "t_router_s",
    "t_norm_s",
    "t_launch_s",
    "t_optimizer_s",
    "t_grad_reduce_s",
    "t_param_gather_s",
)
"""The parts no plan changes (``t_other_s`` is their sum): they follow the model, the tokens per GPU (sample
layout and parallel dimensions) and the cluster. Permutation and the expert GEMMs' FP8 casts (in
``t_fp8_cast_s`` with the dense GEMMs' casts) follow the plan's ``assign``; recompute repeats plan-priced
work."""


def forward_pass(cost: CostModel, work: LayerWork, tw: TokenWork, dense_layers: int, fixed: float) -> float:
    """Seconds of one forward-only pass over the batch; ``fixed``: its exposed copies and critical path."""
    whole = cost.training is not None and cost.training.whole
    f, h = FORWARD_FLOPS_SHARE, FORWARD_BYTES_SHARE
    comp = (work.compute + tw.attn) * f + (work.permute + tw.router[:, None] + tw.norm[:, None]) * h
    comp, dense_cast = _with_casts(comp, work, tw, share=h)
    if not cost.parallel.trivial:
        return _parallel_forward(cost, work, tw, dense_layers, fixed, comp)
    moe, _ = _join(comp, work.comm * 0.5, cost)
    dense = dense_layers * float((tw.dense * f + tw.norm * h + dense_cast).sum())
    total = moe + fixed + dense
    if whole:
        total += float(tw.head_forward.sum()) + cost.launch_time(comp.shape[0], 1.0)
    return total


FORWARD_TP_SHARE = 2.0 / 3.0
"""The forward's share of a tensor-parallel block's exposed collectives (the input all-gather and the
output reduce-scatter of :data:`relibra.cost.tensor.TP_EXPOSED_COLLECTIVES`)."""


def _parallel_forward(
    cost: CostModel, work: LayerWork, tw: TokenWork, dense_layers: int, fixed: float, comp: np.ndarray
) -> float:
    """:func:`forward_pass` through the pipeline (``vpp`` sends per stage and micro-batch, the same bubble)
    and with tensor parallelism's forward collectives."""
    whole = cost.training is not None and cost.training.whole
    f, h = FORWARD_FLOPS_SHARE, FORWARD_BYTES_SHARE
    par = cost.parallel
    tp_fwd = (tw.tp_block if tw.tp_block is not None else np.zeros_like(tw.dense)) * FORWARD_TP_SHARE
    p2p = tw.p2p if tw.p2p is not None else np.zeros_like(tw.dense)
    sp = StagePass(
        comp=comp + _moe_tp_blocks(cost) * tp_fwd[:, None],
        comm=work.comm * 0.5,
        dense=tw.dense * f + tw.norm * h + 2.0 * tp_fwd + _dense_casts(tw, h),
        head=(tw.head_forward + tp_fwd) if whole else np.zeros_like(tw.dense),
        p2p=par.vpp * p2p,
        spread=fixed + (cost.launch_time(comp.shape[0], 1.0) if whole else 0.0),
        overlap=cost.cluster.ep_overlap,
        contention=cost.cluster.comm_sm_share,
    )
    return pipelined(cost.chunk_of_layer(), dense_layers, par.pp, par.vpp, sp).total
