"""The readers behind :mod:`relibra.trace.importers_rl`: recorded rows out of a trainer's structure.

Two layouts cover every RL trainer: a **padded** tensor ``[B, S, L, k]`` with a mask of each sample's real
tokens (verl, AReaL, NeMo-RL, SkyRL's training tensor: :func:`read_padded`) and a **list** of per-sample
recorded rows ``[T_s - 1, L, k]`` (slime, SkyRL's generator output: :func:`read_list`). Both check the
input the same way (dtype wide enough, ids in range, top-k distinct, filler where no route is) and build
the trace through :func:`recorded_trace`, so the importers only say which layout, field and filler their
framework uses. What the rows that are not routes become is described in :mod:`relibra.trace.importers_rl`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from relibra.trace.format import MAX_EXPERTS, RoutingTrace, TraceFormatError, positive_int

__all__ = [
    "MISSING",
    "NEMO_MISSING_ROUTE",
    "UNRECORDED",
    "ImportOptions",
    "fill_route",
    "ids_array",
    "lengths_mask",
    "mask_array",
    "positive",
    "read_list",
    "read_padded",
    "select_layers",
]

UNRECORDED = ("drop", "fill")
"""Values of ``unrecorded``: leave the unrecorded last token out, or keep it with :func:`fill_route`."""
MISSING = ("refuse", "drop")
"""Values of ``missing`` (NeMo-RL's all ``-1`` rows): refuse the input, or drop and count those tokens."""
NEMO_MISSING_ROUTE = -1
"""NeMo-RL's missing-route sentinel (``ROUTED_EXPERTS_MISSING_ROUTE_SENTINEL``,
``nemo_rl/models/generation/interfaces.py``): every top-k slot of the row holds it."""
UNRECORDED_PER_SAMPLE = 1
"""Rows an inference engine does not record per sample: the last sampled token, never run forward (vLLM's
``routed_experts`` and SGLang's ``meta_info.routed_experts`` hold ``tokens - 1`` rows)."""
FILLERS = ("zeros", "arange")
"""What a padded layout holds where it has no route: zeros (verl, AReaL) or :func:`fill_route`."""


@dataclass(frozen=True)
class ImportOptions:
    """What every RL importer passes through to the trace unchanged (the importers' keyword arguments)."""

    moe_layers: Sequence[int] | None
    """Indices of the MoE layers along the recorded layer axis (None: every recorded layer)."""
    unrecorded: str
    """One of :data:`UNRECORDED`."""
    model: str
    source: str
    meta: dict[str, Any] | None
    """Extra metadata merged last into the trace's ``meta``."""


def fill_route(num_layers: int, top_k: int) -> np.ndarray:
    """The filler row ``[0, 1, ..., k-1]`` at every layer: int64 [L, k].

    The valid (distinct) dummy top-k that NeMo-RL (``_fill_routed_experts_padding``,
    ``nemo_rl/models/megatron/data.py``) and SkyRL (``make_replay_padding_indices_np``,
    ``skyrl/backends/skyrl_train/utils/replay_utils.py``) write where they have no route.
    """
    return np.broadcast_to(np.arange(top_k, dtype=np.int64), (num_layers, top_k)).copy()


# ------------------------------------------------------------------------------------------- checks
def positive(name: str, value: Any) -> int:
    """``value`` as a positive int (``num_experts``: at most :data:`MAX_EXPERTS`)."""
    return positive_int(name, value, MAX_EXPERTS if name == "num_experts" else None)


def choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise TraceFormatError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def ids_array(field: str, value: Any) -> np.ndarray:
    """``value`` (numpy array, torch tensor, nested lists) as a numpy array of its own integer dtype."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        if getattr(value, "is_nested", False):
            raise TraceFormatError(f"{field} is a nested tensor; pass the padded tensor or a list of samples")
        try:
            value = value.detach().cpu().numpy()
        except TypeError as err:  # NOTE: torch dtypes numpy has no type for (bfloat16, ...)
            raise TraceFormatError(f"{field} must hold integer expert ids, got dtype {value.dtype}") from err
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as err:  # NOTE: ragged nested lists
        raise TraceFormatError(f"{field} is not a rectangular array of integer ids ({err})") from err
    if arr.dtype.kind not in "iu":
        raise TraceFormatError(f"{field} must hold integer expert ids, got dtype {arr.dtype}")
    return arr


def mask_array(field: str, value: Any) -> np.ndarray:
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


def lengths_mask(field: str, lengths: Any, batch: int, seq: int) -> np.ndarray:
    """Right padding: real tokens are the first ``lengths[b]`` positions of row ``b``. bool [B, S]."""
    arr = ids_array(field, lengths)
    if arr.shape != (batch,):
        raise TraceFormatError(f"{field} must be [{batch}] (one length per sample), got shape {arr.shape}")
    if (arr < 1).any() or (arr > seq).any():
        s = int(np.flatnonzero((arr < 1) | (arr > seq))[0])
        raise TraceFormatError(f"{field}[{s}]={int(arr[s])} lies outside [1, {seq}] (the padded length)")
    return np.arange(seq)[None, :] < arr[:, None]


def check_dtype_holds(field: str, arr: np.ndarray, num_experts: int) -> None:
    """Refuse a dtype too narrow for ``num_experts`` ids: its values may have wrapped when it was made."""
    most = int(np.iinfo(arr.dtype).max)
    if most < num_experts - 1:
        raise TraceFormatError(
            f"{field} has dtype {arr.dtype}, which holds ids up to {most}, but num_experts={num_experts}: "
            "ids past it were wrapped by the cast that made this array; record them in a wider dtype"
        )


def select_layers(field: str, arr: np.ndarray, moe_layers: Sequence[int] | None) -> np.ndarray:
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
            f"layers), got {idx.tolist()}"
        )
    return arr[..., idx, :]


def check_routes(field: str, rows: np.ndarray, where: np.ndarray, num_experts: int) -> None:
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


def check_filler(field: str, arr: np.ndarray, mask: np.ndarray, filler: np.ndarray, what: str) -> None:
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


# -------------------------------------------------------------------------------------- the trace
def recorded_trace(
    per_sample: list[np.ndarray],
    num_experts: int,
    options: ImportOptions,
    *,
    unrecorded_tokens: int,
    missing_routes: int,
) -> RoutingTrace:
    """One batch of per-sample rows ``[n_s, L, k]`` (range-checked int64) -> the trace, with the counts of
    the rows that were not routes in its ``meta``."""
    empty = [s for s, a in enumerate(per_sample) if a.shape[0] == 0]
    if empty:
        raise TraceFormatError(
            f"sample {empty[0]} has no recorded route ({len(empty)} such samples); a one-token sample has "
            "none "
            "(its only token is the unrecorded last one): pass unrecorded='fill' or leave it out"
        )
    top_k, num_layers = per_sample[0].shape[2], per_sample[0].shape[1]
    lens = np.array([a.shape[0] for a in per_sample], dtype=np.int64)
    moe_layers = options.moe_layers
    return RoutingTrace(  # ids were range-checked on their own dtype: the int16 cast keeps them
        experts=np.concatenate(per_sample).astype(np.int16),
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=np.array([0, len(per_sample)], dtype=np.int64),
        meta={
            "num_experts": num_experts,
            "top_k": int(top_k),
            "num_layers": int(num_layers),
            "model": options.model,
            "source": options.source,
            "unrecorded_tokens": unrecorded_tokens,
            "unrecorded": options.unrecorded,
            "missing_routes": missing_routes,
            "moe_layers": None if moe_layers is None else [int(i) for i in moe_layers],
            **(options.meta or {}),
        },
    )


# ------------------------------------------------------------------------------------- padded layout
def _padded_rows(
    real: np.ndarray, route_lengths: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per padded sample: its real-token positions and how many of them are recorded.

    ``real`` bool [B, S]: each sample's real tokens must form one contiguous run. Returns ``start [B]``,
    ``num_real [B]`` and ``num_recorded [B]`` (``route_lengths``, or ``num_real - 1``).
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
        recorded = np.maximum(num_real - UNRECORDED_PER_SAMPLE, 0)
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


def read_padded(
    routed_value: Any,
    real: np.ndarray,
    num_experts: int,
    options: ImportOptions,
    *,
    field: str,
    filler: str,
    route_lengths: Any = None,
    missing: str | None = None,
) -> RoutingTrace:
    """The padded layouts (verl, AReaL, NeMo-RL, SkyRL's padded tensor): ``routed_value [B, S, L, k]``
    with ``real`` bool [B, S] (each sample's real tokens, one contiguous run).

    ``filler``: what padding and unrecorded rows hold (:data:`FILLERS`); ``route_lengths`` [B]: rows
    recorded per sample (None: every real token but the last); ``missing``: None where the framework has
    no missing-route sentinel (a negative id is then out of range), else what to do with NeMo-RL's all
    ``-1`` rows (:data:`MISSING`).
    """
    num_experts = positive("num_experts", num_experts)
    choice("unrecorded", options.unrecorded, UNRECORDED)
    if missing is not None:
        choice("missing", missing, MISSING)
    routed = ids_array(field, routed_value)
    if routed.ndim != 4 or routed.shape[:2] != real.shape:
        raise TraceFormatError(
            f"{field} must be [batch, seq, layers, topk] aligned with the mask {list(real.shape)}, got shape "
            f"{routed.shape}"
        )
    if 0 in routed.shape[2:]:
        raise TraceFormatError(f"{field} has shape {routed.shape}: no layers or no top-k slots")
    if 0 in routed.shape[:2]:
        raise TraceFormatError(
            f"{field} has shape {routed.shape}: an empty batch (no samples or no positions)"
        )
    check_dtype_holds(field, routed, num_experts)
    lengths = None if route_lengths is None else ids_array("route_lengths", route_lengths)
    start, num_real, recorded = _padded_rows(real, lengths)
    num_layers, top_k = routed.shape[2:]
    fill = np.zeros((num_layers, top_k), np.int64) if filler == "zeros" else fill_route(num_layers, top_k)
    pos = np.arange(real.shape[1])[None, :]
    unrec = (pos >= (start + recorded)[:, None]) & real
    check_filler(field, routed, ~real, fill, "padding (mask 0)")
    check_filler(field, routed, unrec, fill, "an unrecorded token (past the recorded rows)")
    routed = select_layers(field, routed, options.moe_layers)
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
        check_routes(field, rows, where, num_experts)
        rows = rows.astype(np.int64)
        if options.unrecorded == "fill":
            extra = int(num_real[s] - recorded[s])
            rows = np.concatenate(
                [rows, np.broadcast_to(fill_route(rows.shape[1], k), (extra, *rows.shape[1:]))]
            )
        per_sample.append(rows)
    return recorded_trace(
        per_sample,
        num_experts,
        options,
        unrecorded_tokens=int((num_real - recorded).sum()),
        missing_routes=dropped,
    )


# --------------------------------------------------------------------------------------- list layout
def read_list(
    routes: Sequence[Any], num_experts: int, options: ImportOptions, *, field: str, tokens: Any
) -> RoutingTrace:
    """Per-sample recorded rows ``[T_s - 1, L, k]`` (slime, SkyRL); ``tokens`` [S] checks ``T_s``."""
    num_experts = positive("num_experts", num_experts)
    choice("unrecorded", options.unrecorded, UNRECORDED)
    if isinstance(routes, np.ndarray) or len(routes) == 0:
        raise TraceFormatError(
            f"{field} must be a non-empty list of per-sample [tokens - 1, layers, topk] arrays"
        )
    counts = None if tokens is None else ids_array("tokens", tokens)
    if counts is not None and counts.shape != (len(routes),):
        raise TraceFormatError(
            f"tokens must be [{len(routes)}] (one token count per sample), got {counts.shape}"
        )
    per_sample, unrec = [], 0
    first: tuple[int, ...] = ()
    for s, value in enumerate(routes):
        name = f"{field}[{s}]"
        arr = ids_array(name, value)
        if arr.ndim != 3 or 0 in arr.shape[1:]:
            raise TraceFormatError(f"{name} must be [tokens - 1, layers, topk], got shape {arr.shape}")
        if s and arr.shape[1:] != first:
            raise TraceFormatError(
                f"{name} has {arr.shape[1]} layers and top-k {arr.shape[2]}, but {field}[0] has {first[0]} "
                f"and {first[1]}: every sample holds the same model's layers and top-k"
            )
        first = arr.shape[1:] if not s else first
        check_dtype_holds(name, arr, num_experts)
        if counts is not None and arr.shape[0] != int(counts[s]) - 1:
            raise TraceFormatError(
                f"{name} has {arr.shape[0]} rows for a sample of tokens[{s}]={int(counts[s])}: the engine "
                "records tokens - 1 (every token but the last)"
            )
        arr = select_layers(name, arr, options.moe_layers)
        where = np.stack([np.full(arr.shape[0], s), np.arange(arr.shape[0])], axis=1)
        check_routes(field, arr, where, num_experts)
        rows = arr.astype(np.int64)
        unrec += UNRECORDED_PER_SAMPLE
        if options.unrecorded == "fill":
            rows = np.concatenate([rows, fill_route(*rows.shape[1:])[None]])
        per_sample.append(rows)
    return recorded_trace(per_sample, num_experts, options, unrecorded_tokens=unrec, missing_routes=0)
