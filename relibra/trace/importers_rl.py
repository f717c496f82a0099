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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from relibra.trace.format import MAX_EXPERTS, RoutingTrace, TraceFormatError, positive_int

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

UNRECORDED = ("drop", "fill")
"""Values of ``unrecorded``: leave the unrecorded last token out, or keep it with :func:`fill_route`."""
MISSING = ("refuse", "drop")
"""Values of ``missing`` (NeMo-RL's all ``-1`` rows): refuse the input, or drop and count those tokens."""
NEMO_MISSING_ROUTE = -1
"""NeMo-RL's missing-route sentinel (``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``,
``nemo_rl/models/generation/interfaces.py``): every top-k slot of the row holds it."""


def fill_route(num_layers: int, top_k: int) -> np.ndarray:
    """The filler row ``[0, 1, ..., k-1]`` at every layer: int64 [L, k].

    The valid (distinct) dummy top-k that NeMo-RL (``_fill_routed_experts_padding``,
    ``nemo_rl/models/megatron/data.py``) and SkyRL (``make_replay_padding_indices_np``,
    ``skyrl/backends/skyrl_train/utils/replay_utils.py``) write where they have no route.
    """
    return np.broadcast_to(np.arange(top_k, dtype=np.int64), (num_layers, top_k)).copy()


def moe_layers_from_freq(num_layers: int, moe_layer_freq: int | Sequence[int]) -> list[int]:
    """Indices of the MoE layers among ``num_layers`` transformer layers, Megatron's ``moe_layer_freq`` rule.

    An int ``f``: layer ``i`` is MoE when ``i % f == 0``; a list: one 0/1 entry per layer (1 = MoE), as
    megatron-core, slime (``fill_routing_replay``) and NeMo-RL (``_global_moe_layer_numbers``) read it.
    """
    num_layers = _positive("num_layers", num_layers)
    if isinstance(moe_layer_freq, Sequence):
        pattern = list(moe_layer_freq)
        if len(pattern) != num_layers or any(p not in (0, 1) for p in pattern):
            raise TraceFormatError(
                f"moe_layer_freq must be a positive int or {num_layers} entries of 0/1, got "
                f"{moe_layer_freq!r}"
            )
        return [i for i, p in enumerate(pattern) if p == 1]
    freq = _positive("moe_layer_freq", moe_layer_freq)
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
        (f"{field}[{pp}][{vp}]", _ids_array(f"{field}[{pp}][{vp}]", stages[pp][vp]))
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


# ------------------------------------------------------------------------------------------ helpers
def _positive(name: str, value: Any) -> int:
    return positive_int(name, value, MAX_EXPERTS if name == "num_experts" else None)


def _ids_array(field: str, value: Any) -> np.ndarray:
    """``value`` (numpy array, torch tensor, nested lists) as a numpy array of its own integer dtype."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        if getattr(value, "is_nested", False):
            raise TraceFormatError(f"{field} is a nested tensor; pass the padded tensor or a list of samples")
        try:
            value = value.detach().cpu().numpy()
        except TypeError as err:  # NOTE: torch dtypes numpy has no type for (bfloat16, ...)
            raise TraceFormatError(f"{field} must hold integer expert ids, got dtype {value.dtype}") from err
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TraceFormatError(f"{field} must hold integer expert ids, got dtype {arr.dtype}")
    return arr


def _check_dtype_holds(field: str, arr: np.ndarray, num_experts: int) -> None:
    """Refuse a dtype too narrow for ``num_experts`` ids: its values may have wrapped when it was made."""
    most = int(np.iinfo(arr.dtype).max)
    if most < num_experts - 1:
        raise TraceFormatError(
            f"{field} has dtype {arr.dtype}, which holds ids up to {most}, but num_experts={num_experts}: "
            "ids past it were wrapped by the cast that made this array; record them in a wider dtype"
        )


def _select_layers(field: str, arr: np.ndarray, moe_layers: Sequence[int] | None) -> np.ndarray:
    """``arr [..., L, k]`` restricted to ``moe_layers`` (indices into its layer axis), in that order."""
    if moe_layers is None:
        return arr
    idx = np.asarray(list(moe_layers))
    num_layers = arr.shape[-2]
    if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
        raise TraceFormatError(f"moe_layers must be a non-empty list of layer indices, got {moe_layers!r}")
    if idx.min() < 0 or idx.max() >= num_layers or np.unique(idx).size != idx.size:
        raise TraceFormatError(
            f"moe_layers must be distinct indices in [0, {num_layers}) ({field} records {num_layers} "
            "layers), "
            f"got {idx.tolist()}"
        )
    return arr[..., idx, :]


def _check_routes(field: str, rows: np.ndarray, where: np.ndarray, num_experts: int) -> None:
    """Recorded rows ``[n, L, k]`` must be routes: ids in ``[0, E)`` and a token's top-k distinct.

    ``where`` int [n, 2] names each row in the input's coordinates (sample, position).
    """
    if not rows.size:
        return
    lo, hi = int(rows.min()), int(rows.max())
    if lo < 0 or hi >= num_experts:
        bad = int(np.flatnonzero(((rows < 0) | (rows >= num_experts)).any(axis=(1, 2)))[0])
        raise TraceFormatError(
            f"{field}[{where[bad, 0]}, {where[bad, 1]}]: expert ids must lie in [0, {num_experts}), found "
            f"{lo}..{hi} in the recorded rows"
        )
    if rows.shape[-1] > 1:
        ordered = np.sort(rows, axis=-1)
        dup = (ordered[..., 1:] == ordered[..., :-1]).any(axis=(1, 2))
        if dup.any():
            bad = int(np.flatnonzero(dup)[0])
            raise TraceFormatError(
                f"{field}[{where[bad, 0]}, {where[bad, 1]}] names one expert twice in a token's top-k: not a "
                "route (a filler row inside the recorded span? check the mask, the lengths and route_lengths)"
            )


def _check_filler(field: str, arr: np.ndarray, mask: np.ndarray, filler: np.ndarray, what: str) -> None:
    """Rows of ``arr [B, S, L, k]`` where ``mask [B, S]`` is set must equal ``filler [L, k]``."""
    if not mask.any():
        return
    bad = mask & ~(arr == filler).all(axis=(2, 3))
    if bad.any():
        s, t = (int(v) for v in np.argwhere(bad)[0])
        raise TraceFormatError(
            f"{field}[{s}, {t}] is {what} but holds {arr[s, t].tolist()[0]}... instead of the framework's "
            "filler: the routes are not aligned with the mask / lengths given"
        )


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise TraceFormatError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def _trace(
    per_sample: list[np.ndarray],
    num_experts: int,
    *,
    model: str,
    source: str,
    meta: dict[str, Any],
) -> RoutingTrace:
    empty = [s for s, a in enumerate(per_sample) if a.shape[0] == 0]
    if empty:
        raise TraceFormatError(
            f"sample {empty[0]} has no recorded route ({len(empty)} such samples); a one-token sample has "
            "none "
            "(its only token is the unrecorded last one): pass unrecorded='fill' or leave it out"
        )
    top_k, num_layers = per_sample[0].shape[2], per_sample[0].shape[1]
    lens = np.array([a.shape[0] for a in per_sample], dtype=np.int64)
    return RoutingTrace(  # ids were range-checked on their own dtype: the int16 cast keeps them
        experts=np.concatenate(per_sample).astype(np.int16),
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=np.array([0, len(per_sample)], dtype=np.int64),
        meta={
            "num_experts": num_experts,
            "top_k": int(top_k),
            "num_layers": int(num_layers),
            "model": model,
            "source": source,
            **meta,
        },
    )


def _padded_rows(
    field: str,
    routed: np.ndarray,
    real: np.ndarray,
    route_lengths: np.ndarray | None,
    default_unrecorded: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per padded sample: its real-token positions and how many of them are recorded.

    ``real`` bool [B, S]: each sample's real tokens must form one contiguous run. Returns ``start [B]``,
    ``num_real [B]`` and ``num_recorded [B]`` (``route_lengths``, or ``num_real - default_unrecorded``).
    """
    num_real = real.sum(axis=1).astype(np.int64)
    start = np.where(num_real > 0, real.argmax(axis=1), 0).astype(np.int64)
    positions = np.arange(real.shape[1])[None, :]
    run = (positions >= start[:, None]) & (positions < (start + num_real)[:, None])
    if not np.array_equal(run, real):
        s = int(np.flatnonzero((run != real).any(axis=1))[0])
        raise TraceFormatError(f"the mask of sample {s} is not one contiguous run of real tokens")
    if (num_real == 0).any():
        s = int(np.flatnonzero(num_real == 0)[0])
        raise TraceFormatError(f"sample {s} has no real token (its mask row is all 0)")
    if route_lengths is None:
        recorded = np.maximum(num_real - default_unrecorded, 0)
    else:
        recorded = np.asarray(route_lengths)
        if recorded.shape != num_real.shape or recorded.dtype.kind not in "iu":
            raise TraceFormatError(f"route_lengths must be integers [{num_real.shape[0]}], got {recorded!r}")
        if (recorded < 0).any() or (recorded > num_real).any():
            s = int(np.flatnonzero((recorded < 0) | (recorded > num_real))[0])
            raise TraceFormatError(
                f"route_lengths[{s}]={int(recorded[s])} lies outside [0, {int(num_real[s])}] (its real "
                "tokens)"
            )
        recorded = recorded.astype(np.int64)
    return start, num_real, recorded


def _from_padded(
    routed_value: Any,
    real: np.ndarray,
    num_experts: int,
    *,
    field: str,
    filler: str,
    route_lengths: Any,
    moe_layers: Sequence[int] | None,
    unrecorded: str,
    missing: str | None = None,
    default_unrecorded: int = 1,
    model: str,
    source: str,
    meta: dict[str, Any] | None,
) -> RoutingTrace:
    """The one path of the padded layouts (verl, AReaL, NeMo-RL, SkyRL's padded tensor).

    ``filler``: what padding and unrecorded rows hold (``zeros`` or ``arange``: :func:`fill_route`);
    ``missing``: None where the framework has no missing-route sentinel (a negative id is then out of
    range), else what to do with NeMo-RL's all ``-1`` rows.
    """
    num_experts = _positive("num_experts", num_experts)
    _choice("unrecorded", unrecorded, UNRECORDED)
    if missing is not None:
        _choice("missing", missing, MISSING)
    routed = _ids_array(field, routed_value)
    if routed.ndim != 4 or routed.shape[:2] != real.shape:
        raise TraceFormatError(
            f"{field} must be [batch, seq, layers, topk] aligned with the mask {list(real.shape)}, got shape "
            f"{routed.shape}"
        )
    if 0 in routed.shape[2:]:
        raise TraceFormatError(f"{field} has shape {routed.shape}: no layers or no top-k slots")
    _check_dtype_holds(field, routed, num_experts)
    lengths = None if route_lengths is None else _ids_array("route_lengths", route_lengths)
    start, num_real, recorded = _padded_rows(field, routed, real, lengths, default_unrecorded)
    num_layers, top_k = routed.shape[2:]
    if filler != "none":
        fill = np.zeros((num_layers, top_k), np.int64) if filler == "zeros" else fill_route(num_layers, top_k)
        pos = np.arange(real.shape[1])[None, :]
        unrec = (pos >= (start + recorded)[:, None]) & real
        _check_filler(field, routed, ~real, fill, "padding (mask 0)")
        _check_filler(field, routed, unrec, fill, "an unrecorded token (past the recorded rows)")
    routed = _select_layers(field, routed, moe_layers)
    k = routed.shape[-1]
    per_sample, dropped = [], 0
    for s in range(routed.shape[0]):
        rows = routed[s, start[s] : start[s] + recorded[s]]
        where = np.stack([np.full(rows.shape[0], s), np.arange(start[s], start[s] + recorded[s])], axis=1)
        gone = (rows == NEMO_MISSING_ROUTE).all(axis=(1, 2)) if missing is not None else None
        if gone is not None and gone.any():
            if missing == "refuse":
                t = int(where[np.flatnonzero(gone)[0], 1])
                raise TraceFormatError(
                    f"{field}[{s}, {t}] is a missing route (all {NEMO_MISSING_ROUTE}): pass missing='drop' "
                    "to "
                    "leave such tokens out and count them"
                )
            dropped += int(gone.sum())
            rows, where = rows[~gone], where[~gone]
        _check_routes(field, rows, where, num_experts)
        rows = rows.astype(np.int64)
        if unrecorded == "fill":
            extra = int(num_real[s] - recorded[s])
            rows = np.concatenate(
                [rows, np.broadcast_to(fill_route(rows.shape[1], k), (extra, *rows.shape[1:]))]
            )
        per_sample.append(rows)
    unrecorded_tokens = int((num_real - recorded).sum())
    return _trace(
        per_sample,
        num_experts,
        model=model,
        source=source,
        meta={
            "unrecorded_tokens": unrecorded_tokens,
            "unrecorded": unrecorded,
            "missing_routes": dropped,
            "moe_layers": None if moe_layers is None else [int(i) for i in moe_layers],
            **(meta or {}),
        },
    )


def _mask(field: str, value: Any) -> np.ndarray:
    """An attention / loss mask [B, S] of 0/1 (or bool) as bool."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.ndim != 2:
        raise TraceFormatError(f"{field} must be [batch, seq], got shape {arr.shape}")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iuf" or not np.isin(arr, (0, 1)).all():
            raise TraceFormatError(f"{field} must hold 0/1 (or bool), got dtype {arr.dtype}")
    return arr.astype(bool)


def _lengths_mask(field: str, lengths: Any, batch: int, seq: int) -> np.ndarray:
    """Right padding: real tokens are the first ``lengths[b]`` positions of row ``b``. bool [B, S]."""
    arr = _ids_array(field, lengths)
    if arr.shape != (batch,):
        raise TraceFormatError(f"{field} must be [{batch}] (one length per sample), got shape {arr.shape}")
    if (arr < 1).any() or (arr > seq).any():
        s = int(np.flatnonzero((arr < 1) | (arr > seq))[0])
        raise TraceFormatError(f"{field}[{s}]={int(arr[s])} lies outside [1, {seq}] (the padded length)")
    return np.arange(seq)[None, :] < arr[:, None]


def _from_list(
    routes: Sequence[Any],
    num_experts: int,
    *,
    field: str,
    tokens: Any,
    moe_layers: Sequence[int] | None,
    unrecorded: str,
    model: str,
    source: str,
    meta: dict[str, Any] | None,
) -> RoutingTrace:
    """Per-sample recorded rows ``[T_s - 1, L, k]`` (slime, SkyRL); ``tokens`` [S] checks ``T_s``."""
    num_experts = _positive("num_experts", num_experts)
    _choice("unrecorded", unrecorded, UNRECORDED)
    if isinstance(routes, np.ndarray) or len(routes) == 0:
        raise TraceFormatError(
            f"{field} must be a non-empty list of per-sample [tokens - 1, layers, topk] arrays"
        )
    counts = None if tokens is None else _ids_array("tokens", tokens)
    if counts is not None and counts.shape != (len(routes),):
        raise TraceFormatError(
            f"tokens must be [{len(routes)}] (one token count per sample), got {counts.shape}"
        )
    per_sample, unrec = [], 0
    for s, value in enumerate(routes):
        name = f"{field}[{s}]"
        arr = _ids_array(name, value)
        if arr.ndim != 3 or 0 in arr.shape[1:]:
            raise TraceFormatError(f"{name} must be [tokens - 1, layers, topk], got shape {arr.shape}")
        _check_dtype_holds(name, arr, num_experts)
        if counts is not None and arr.shape[0] != int(counts[s]) - 1:
            raise TraceFormatError(
                f"{name} has {arr.shape[0]} rows for a sample of tokens[{s}]={int(counts[s])}: the engine "
                "records tokens - 1 (every token but the last)"
            )
        arr = _select_layers(name, arr, moe_layers)
        where = np.stack([np.full(arr.shape[0], s), np.arange(arr.shape[0])], axis=1)
        _check_routes(field, arr, where, num_experts)
        rows = arr.astype(np.int64)
        unrec += 1
        if unrecorded == "fill":
            rows = np.concatenate([rows, fill_route(*rows.shape[1:])[None]])
        per_sample.append(rows)
    return _trace(
        per_sample,
        num_experts,
        model=model,
        source=source,
        meta={
            "unrecorded_tokens": unrec,
            "unrecorded": unrecorded,
            "missing_routes": 0,
            "moe_layers": None if moe_layers is None else [int(i) for i in moe_layers],
            **(meta or {}),
        },
    )


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
    mask = _mask("attention_mask", attention_mask)
    return _from_padded(
        routed_experts,
        mask,
        num_experts,
        field="routed_experts",
        filler="zeros",
        route_lengths=route_lengths,
        moe_layers=moe_layers,
        unrecorded=unrecorded,
        model=model,
        source=source,
        meta=meta,
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
    mask = _mask("attention_mask", attention_mask)
    return _from_padded(
        routed_experts,
        mask,
        num_experts,
        field="routed_experts",
        filler="zeros",
        route_lengths=route_lengths,
        moe_layers=None,
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
    arr = _ids_array("routed_experts", routed_experts)
    if arr.ndim == 3:
        arr = arr[None]
    lengths = _ids_array("input_lengths", input_lengths)
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
    mask = _lengths_mask("input_lengths", input_lengths, arr.shape[0], arr.shape[1])
    return _from_padded(
        arr,
        mask,
        num_experts,
        field="routed_experts",
        filler="arange",
        route_lengths=None,
        moe_layers=moe_layers,
        unrecorded=unrecorded,
        missing=missing,
        model=model,
        source=source,
        meta=meta,
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
    if attention_mask is None:
        if route_lengths is not None:
            raise TraceFormatError("route_lengths goes with the padded tensor form: pass attention_mask too")
        return _from_list(
            rollout_expert_indices,
            num_experts,
            field="rollout_expert_indices",
            tokens=tokens,
            moe_layers=moe_layers,
            unrecorded=unrecorded,
            model=model,
            source=source,
            meta=meta,
        )
    if route_lengths is None:
        raise TraceFormatError(
            "route_lengths is required with the padded rollout_expert_indices: SkyRL's filler rows are valid "
            "top-k routes, so only the per-sample route counts say where the routes end"
        )
    return _from_padded(
        rollout_expert_indices,
        _mask("attention_mask", attention_mask),
        num_experts,
        field="rollout_expert_indices",
        filler="arange",
        route_lengths=route_lengths,
        moe_layers=moe_layers,
        unrecorded=unrecorded,
        model=model,
        source=source,
        meta=meta,
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
    return _from_list(
        rollout_routed_experts,
        num_experts,
        field="rollout_routed_experts",
        tokens=tokens,
        moe_layers=moe_layers,
        unrecorded=unrecorded,
        model=model,
        source=source,
        meta=meta,
    )
