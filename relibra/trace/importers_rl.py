"""Importers for the routes RL trainers hold in memory (routing replay, R3) -> :class:`RoutingTrace`.

Every open RL trainer that replays rollout routes in training keeps them in its own layout. Each importer
below takes the structure the trainer holds at the point where ReLibra plans (after rollout, before the
update) and returns a trace of the **recorded** routes only. Three kinds of rows are not routes and are
never counted as one (in particular never as expert 0):

* **padding**: positions outside a sample (the trainer's attention mask or lengths say where);
* **the unrecorded last token**: an inference engine records the routes of the tokens it runs forward
  through; the last sampled token is never run, so a sample of ``T`` tokens has ``T - 1`` recorded rows
  (vLLM's ``routed_experts`` and SGLang's ``meta_info.routed_experts`` alike). The trainers put a filler
  row there; ``unrecorded="drop"`` (default) leaves that token out of the trace, ``unrecorded="fill"``
  keeps it with :func:`fill_route` (``0, 1, ..., k-1`` at every layer), for a caller that replays that
  same filler in training and needs the plan's loads to match what is replayed (the verl hook,
  :mod:`relibra.integrations.verl`). ``meta["unrecorded_tokens"]`` counts them;
* **missing routes** (NeMo-RL's all ``-1`` rows, tokens no capture covered): refused by default
  (``missing="refuse"``) or dropped and counted in ``meta["missing_routes"]`` (``missing="drop"``).

Per framework (sources read at the commits named in docs/integrations.md):

============  ==========================================  =========  ===========================  =========
importer      structure                                   padding    filler (padding, last token)  layers
============  ==========================================  =========  ===========================  =========
from_verl     ``batch["routed_experts"]`` [bs, seq, L, k]  left+right zeros                        all / MoE
from_areal    ``routed_experts`` [bs, seq, L_moe, k]      left       zeros                        MoE
from_skyrl    ``rollout_expert_indices`` list [T_s-1,L,k]  none       (padded form: ``0..k-1``)     all / MoE
from_nemo_rl  ``routed_experts`` [B, S, L, k] / [1,T,L,k]  right      ``0..k-1``; missing ``-1``   all / MoE
from_slime    ``rollout_routed_experts`` list [T_s-1,L,k]  none       none                         all
============  ==========================================  =========  ===========================  =========

Layer layout: engines record every transformer layer (``L`` = ``num_hidden_layers``, dense layers
included, e.g. DeepSeek-V3's first three); ``moe_layers`` picks the MoE layers (:func:`moe_layers_from_freq`
turns Megatron's ``moe_layer_freq`` into them). A pipeline-parallel trainer holds one stage's layers per
rank: :func:`join_pipeline_stages` puts the stages back in global layer order.

Dtypes: uint8, int8, int16, int32 or int64, from numpy or torch (never cast before the check): a dtype
that cannot hold every id of ``num_experts`` experts is refused (an id past its range was wrapped by the
cast that made it), then every id is range-checked on its own dtype. A malformed input is a
:class:`~relibra.trace.format.TraceFormatError` naming the field and the problem.

The two layouts' readers and their checks live in :mod:`relibra.trace.rl_rows`; each importer here only
names its framework's layout, fields and filler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from relibra.trace.format import RoutingTrace, TraceFormatError
from relibra.trace.rl_rows import (
    ImportOptions,
    fill_route,
    ids_array,
    lengths_mask,
    mask_array,
    positive,
    read_list,
    read_padded,
)

__all__ = [
    "fill_route",
    "from_areal",
    "from_nemo_rl",
    "from_skyrl",
    "from_slime",
    "from_verl",
    "join_pipeline_stages",
    "moe_layers_from_freq",
]


def moe_layers_from_freq(num_layers: int, moe_layer_freq: int | Sequence[int]) -> list[int]:
    """Indices of the MoE layers among ``num_layers`` transformer layers, Megatron's ``moe_layer_freq`` rule.

    An int ``f``: layer ``i`` is MoE when ``i % f == 0``; a list: one 0/1 entry per layer (1 = MoE), as
    megatron-core, slime (``fill_routing_replay``) and NeMo-RL (``_global_moe_layer_numbers``) read it.
    """
    num_layers = positive("num_layers", num_layers)
    if isinstance(moe_layer_freq, Sequence):
        pattern = list(moe_layer_freq)
        if len(pattern) != num_layers or any(p not in (0, 1) for p in pattern):
            raise TraceFormatError(
                f"moe_layer_freq must be a positive int or {num_layers} entries of 0/1, got "
                f"{moe_layer_freq!r}"
            )
        return [i for i, p in enumerate(pattern) if p == 1]
    freq = positive("moe_layer_freq", moe_layer_freq)
    return [i for i in range(num_layers) if i % freq == 0]


def join_pipeline_stages(stages: Sequence[Sequence[Any]], field: str = "stages") -> np.ndarray:
    """Per-stage route slices back in global layer order: ``stages[pp][vp]`` each ``[..., L_chunk, k]``.

    Megatron's interleaved layout: virtual stage ``vp`` of pipeline rank ``pp`` holds the ``vp * P + pp``-th
    chunk of layers, so the global order is ``for vp: for pp`` (as verl's ``pp_gather`` joins them). Without
    virtual stages pass one chunk per rank. Returns the concatenation along the layer axis (-2).
    """
    if not stages or any(len(s) != len(stages[0]) for s in stages) or not stages[0]:
        raise TraceFormatError(f"{field} must be a non-empty [pp][vp] list with as many chunks on every rank")
    chunks = [
        (f"{field}[{pp}][{vp}]", ids_array(f"{field}[{pp}][{vp}]", stages[pp][vp]))
        for vp in range(len(stages[0]))
        for pp in range(len(stages))
    ]
    lead, k = chunks[0][1].shape[:-2], chunks[0][1].shape[-1]
    for name, arr in chunks:
        if arr.ndim < 2 or arr.shape[:-2] != lead or arr.shape[-1] != k:
            raise TraceFormatError(
                f"{name} has shape {arr.shape}; every chunk must be [{', '.join(map(str, lead))}, L_chunk, "
                f"{k}]"
            )
    return np.concatenate([arr for _, arr in chunks], axis=-2)


# ---------------------------------------------------------------------------------------- importers
def from_verl(
    routed_experts: Any,
    attention_mask: Any,
    num_experts: int,
    *,
    moe_layers: Sequence[int] | None = None,
    route_lengths: Any = None,
    unrecorded: str = "drop",
    model: str = "unknown",
    source: str = "verl",
    meta: dict[str, Any] | None = None,
) -> RoutingTrace:
    """verl R3: ``batch.batch["routed_experts"]`` [bs, seq, L, k] with ``batch.batch["attention_mask"]``.

    Layout (``verl/experimental/agent_loop/agent_loop.py``, ``_postprocess``): each sample's ``[len, L, k]``
    from the rollout server is written at the sample's first real position of ``input_ids`` (prompt
    left-padded, response right-padded), in a zero tensor: padding rows and the unrecorded last token are
    zeros. vLLM and SGLang record ``len = real tokens - 1`` rows; ``route_lengths`` [bs] overrides that
    (verl's R2 record path records every real token: pass the real token counts). Rows past the recorded
    ones must be zeros, else the input is refused (the routes are not where the mask says). ``moe_layers``
    picks the MoE layers of an engine that records every transformer layer. Inside the recorded span an
    all-zero row with ``k > 1`` names expert 0 twice: refused (a route the rollout did not record). With
    ``k == 1`` zeros cannot be told from expert 0, so ``route_lengths`` must then be right.
    """
    return read_padded(
        routed_experts,
        mask_array("attention_mask", attention_mask),
        num_experts,
        ImportOptions(moe_layers, unrecorded, model, source, meta),
        field="routed_experts",
        filler="zeros",
        route_lengths=route_lengths,
    )


def from_areal(
    routed_experts: Any,
    attention_mask: Any,
    num_experts: int,
    *,
    route_lengths: Any = None,
    unrecorded: str = "drop",
    model: str = "unknown",
    source: str = "areal",
    meta: dict[str, Any] | None = None,
) -> RoutingTrace:
    """AReaL R3: ``routed_experts`` (bs, seq, num_moe_layers, topk), left-padded with zeros, with its mask.

    Layout (``areal/engine/megatron_engine_r3_patch.py``, ``_align_routed_experts_to_mask``): real tokens
    at the right end of each row, padding zeros; the SGLang capture (``areal/engine/sglang_remote.py``)
    holds ``prompt + completion - 1`` rows, so the last real token is unrecorded (zeros). Only MoE layers
    are recorded. The checks are those of :func:`from_verl`.
    """
    return from_verl(
        routed_experts,
        attention_mask,
        num_experts,
        route_lengths=route_lengths,
        unrecorded=unrecorded,
        model=model,
        source=source,
        meta=meta,
    )


def from_nemo_rl(
    routed_experts: Any,
    input_lengths: Any,
    num_experts: int,
    *,
    moe_layers: Sequence[int] | None = None,
    missing: str = "refuse",
    unrecorded: str = "drop",
    model: str = "unknown",
    source: str = "nemo-rl",
    meta: dict[str, Any] | None = None,
) -> RoutingTrace:
    """NeMo-RL: ``routed_experts`` [B, S, L, k] (right-padded) with ``input_lengths`` [B], or packed.

    Layout (``nemo_rl/models/generation/vllm/utils.py``, ``pad_and_align_routed_expert_indices``; the
    shapes ``nemo_rl/models/megatron/router_replay.py`` accepts): per sample, rows ``0 .. len - 2`` are
    vLLM's routes, rows vLLM did not return are the all ``-1`` missing-route sentinel, the last token and
    the padding hold the filler ``0, 1, ..., k-1``; dtype int8 / int16 / int32 by expert count
    (``resolve_routed_experts_dtype``). Packed forms ``[1, T, L, k]`` or ``[T, L, k]`` hold the samples
    one after another: ``input_lengths`` must then sum to ``T`` (with one length, ``[1, S, L, k]`` is
    one right-padded sample). ``missing``: ``refuse`` (default) or
    ``drop`` (NeMo-RL routes those tokens natively in training, so their experts are unknown here; the
    count is ``meta["missing_routes"]``). ``moe_layers``: the MoE layers of vLLM's full-transformer
    layout (NeMo-RL's ``_payload_indices_for_moe_layers``).
    """
    arr = ids_array("routed_experts", routed_experts)
    if arr.ndim == 3:
        arr = arr[None]
    lengths = ids_array("input_lengths", input_lengths)
    if arr.ndim == 4 and arr.shape[0] == 1 and lengths.size != 1:  # packed; one sample is the padded form
        if (
            lengths.ndim != 1
            or lengths.size == 0
            or (lengths < 1).any()
            or int(lengths.sum()) != arr.shape[1]
        ):
            raise TraceFormatError(
                f"input_lengths must be positive per-sample lengths summing to the packed routed_experts' "
                f"{arr.shape[1]} tokens, got {lengths.tolist() if lengths.ndim == 1 else lengths.shape}"
            )
        offsets = np.r_[0, np.cumsum(lengths)]
        seq = int(lengths.max())
        padded = np.empty((lengths.size, seq, *arr.shape[2:]), dtype=arr.dtype)
        padded[...] = fill_route(*arr.shape[2:]).astype(arr.dtype)
        for s in range(lengths.size):
            padded[s, : lengths[s]] = arr[0, offsets[s] : offsets[s + 1]]
        arr, input_lengths = padded, lengths
    if arr.ndim != 4:
        raise TraceFormatError(
            f"routed_experts must be [B, S, L, k], [1, T, L, k] or [T, L, k], got {arr.shape}"
        )
    return read_padded(
        arr,
        lengths_mask("input_lengths", input_lengths, arr.shape[0], arr.shape[1]),
        num_experts,
        ImportOptions(moe_layers, unrecorded, model, source, meta),
        field="routed_experts",
        filler="arange",
        missing=missing,
    )


def from_skyrl(
    rollout_expert_indices: Any,
    num_experts: int,
    *,
    attention_mask: Any = None,
    route_lengths: Any = None,
    tokens: Any = None,
    moe_layers: Sequence[int] | None = None,
    unrecorded: str = "drop",
    model: str = "unknown",
    source: str = "skyrl",
    meta: dict[str, Any] | None = None,
) -> RoutingTrace:
    """SkyRL: the generator's ``rollout_expert_indices`` (a list of per-sample ``[n, L, k]``), or its padded
    training tensor ``(batch, seq_len, layer_num, topk)`` with ``attention_mask`` and ``route_lengths``.

    The list (``skyrl/train/generators/base.py``; dtype uint8 / int16 / int32 by the largest id,
    ``compact_routed_expert_indices`` in ``skyrl/backends/skyrl_train/utils/routed_experts.py``) holds vLLM's
    rows, every token but the last (``tokens`` [S], if given, checks ``n == tokens - 1``). The padded
    tensor (``convert_prompts_responses_to_batch_tensors``, ``skyrl/train/dataset/preprocess.py``) is
    left-padded and fills padding and every row past a sample's routes with ``0, 1, ..., k-1`` (a valid
    top-k, so it cannot be told from a route): there ``route_lengths`` [B] (rows recorded per sample) is
    required. vLLM records every transformer layer: ``moe_layers`` picks the MoE ones.
    """
    options = ImportOptions(moe_layers, unrecorded, model, source, meta)
    if attention_mask is None:
        if route_lengths is not None:
            raise TraceFormatError("route_lengths goes with the padded tensor form: pass attention_mask too")
        return read_list(
            rollout_expert_indices, num_experts, options, field="rollout_expert_indices", tokens=tokens
        )
    if route_lengths is None:
        raise TraceFormatError(
            "route_lengths is required with the padded rollout_expert_indices: SkyRL's filler rows are valid "
            "top-k routes, so only the per-sample route counts say where the routes end"
        )
    return read_padded(
        rollout_expert_indices,
        mask_array("attention_mask", attention_mask),
        num_experts,
        options,
        field="rollout_expert_indices",
        filler="arange",
        route_lengths=route_lengths,
    )


def from_slime(
    rollout_routed_experts: Sequence[Any],
    num_experts: int,
    *,
    tokens: Any = None,
    moe_layers: Sequence[int] | None = None,
    unrecorded: str = "drop",
    model: str = "unknown",
    source: str = "slime",
    meta: dict[str, Any] | None = None,
) -> RoutingTrace:
    """slime: ``rollout_data["rollout_routed_experts"]``, a list of int32 ``[T_s - 1, num_layers, topk]``.

    Layout (``Sample`` in ``slime/utils/types.py`` decodes SGLang's int32 ``routed_experts`` into
    ``[len(tokens) - 1, num_layers, moe_router_topk]``; ``slime/ray/rollout.py`` gathers them; in training
    ``prepare_routed_experts_for_routing_replay`` (``slime/backends/megatron_utils/cp_utils.py``) pads the
    last token with a filler route and ``fill_routing_replay`` (``slime/backends/megatron_utils/actor.py``)
    skips the dense layers of ``moe_layer_freq``). ``tokens`` [S] (``len(sample.tokens)``), if given,
    checks the row counts; ``moe_layers`` = ``moe_layers_from_freq(num_layers, moe_layer_freq)``.
    """
    return read_list(
        rollout_routed_experts,
        num_experts,
        ImportOptions(moe_layers, unrecorded, model, source, meta),
        field="rollout_routed_experts",
        tokens=tokens,
    )
