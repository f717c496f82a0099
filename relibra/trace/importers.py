"""Importers: routing recorded by serving engines, RL frameworks and public traces -> :class:`RoutingTrace`.

Per sample, vLLM (``routed_experts``, ``[seq_len, layer_num, topk]``), SGLang (``meta_info.routed_experts``:
base64 of int32, reshaped to ``[-1, layer_num, topk]``), verl R3 and Megatron-core's ``RouterReplay``
(per-layer ``[tokens, topk]`` lists) record exactly what a trace holds, so those importers only stack and
concatenate. The loaders of the public traces in ``../shared/traces`` follow that folder's README:

- :func:`load_olmoe_decode`: OLMoE-1B-7B decode chunks; one sample per prompt, domains kept;
- :func:`load_flame_moe`: FLAME-MoE 290M layer files (PyTorch zip archives); one sample per sequence;
- :func:`load_mixtral_jsonl`: Mixtral-8x7B JSON lines; one sample per (dataset, problem); tokens that miss
  a layer are reported (refused, or dropped and listed with ``drop_incomplete=True``), never filled in;
- :func:`load_olmoe_prefill_counts`, :func:`load_qwen3_counts`: count-only data as
  :class:`~relibra.types.SampleCounts` (no per-token routes), for calibration.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relibra.trace.format import MAX_EXPERTS, RoutingTrace, TraceFormatError, positive_int
from relibra.trace.rl_rows import ids_array, select_layers
from relibra.types import SampleCounts

__all__ = [
    "SGLANG_DTYPES",
    "IncompleteToken",
    "IncompleteTokensError",
    "fill_route",
    "from_areal",
    "from_nemo_rl",
    "from_router_replay",
    "from_sglang",
    "from_skyrl",
    "from_slime",
    "from_verl",
    "from_vllm",
    "join_pipeline_stages",
    "load_flame_moe",
    "load_mixtral_jsonl",
    "load_olmoe_decode",
    "load_olmoe_prefill_counts",
    "load_qwen3_counts",
    "moe_layers_from_freq",
]

OLMOE_DOMAINS = ("general", "coding", "math", "reasoning")
"""``domain_id`` 0..3 of the OLMoE traces (their README)."""


def _batch_offsets(num_samples: int, samples_per_batch: int | None) -> np.ndarray:
    if samples_per_batch is None:
        return np.array([0, num_samples], dtype=np.int64)
    if samples_per_batch < 1:
        raise ValueError(f"samples_per_batch must be >= 1, got {samples_per_batch}")
    return np.r_[np.arange(0, num_samples, samples_per_batch), num_samples].astype(np.int64)


def _int_ids(name: str, arr: np.ndarray, num: int, what: str) -> None:
    """Refuse ``arr`` unless it holds integers in ``[0, num)``: checked on the original dtype, BEFORE any
    cast, so that a value a narrower dtype cannot hold is refused instead of wrapped around."""
    if arr.dtype.kind not in "iu":
        raise TraceFormatError(f"{name} must hold integer {what}, got dtype {arr.dtype}")
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= num:
            raise TraceFormatError(f"{name}: {what} must lie in [0, {num}), found {lo}..{hi}")


def from_vllm(
    routed_experts: Sequence[np.ndarray],
    num_experts: int,
    *,
    model: str = "unknown",
    source: str = "vllm",
    batch_offsets: np.ndarray | None = None,
    sample_domain: np.ndarray | None = None,
    domain_names: tuple[str, ...] = (),
    meta: dict[str, Any] | None = None,
    moe_layers: Sequence[int] | None = None,
) -> RoutingTrace:
    """A trace from per-sample routes, one array ``[seq_len, layer_num, topk]`` per sample (vLLM's form).

    Every value is range-checked on its own dtype before it is cast to the trace's (int16 ids), so
    nothing wraps around; a bad input is a :class:`TraceFormatError` naming the array. vLLM returns
    int16 ``[seq_len - 1, num_hidden_layers, topk]`` (every token but the last, every transformer layer).

    Args:
        routed_experts: S arrays of integer expert ids, each ``[T_s, L, k]`` with the same ``L`` and ``k``.
        num_experts: ``E`` (ids must lie in ``[0, E)``; at most :data:`~relibra.trace.format.MAX_EXPERTS`).
        batch_offsets: int [B + 1] or None (one batch).
        sample_domain: int [S] or None, indices into ``domain_names``.
        meta: extra JSON-serialisable metadata merged into the trace's ``meta``; it may not restate
            ``num_experts``, ``top_k`` or ``num_layers`` differently from the routes (refused, naming it).
        moe_layers: indices of the MoE layers along ``layer_num`` (None: every recorded layer is one),
            for engines that record dense layers too (DeepSeek-V3's first three);
            :func:`relibra.trace.importers_rl.moe_layers_from_freq` builds them from ``moe_layer_freq``.
    """
    num_experts = positive_int("num_experts", num_experts, MAX_EXPERTS)
    if not isinstance(routed_experts, Sequence) or isinstance(routed_experts, str | bytes):
        raise TraceFormatError(
            f"routed_experts must be a list of per-sample [seq_len, layer_num, topk] arrays, got "
            f"{type(routed_experts).__name__}"
        )
    if len(routed_experts) == 0:
        raise TraceFormatError("routed_experts is empty: a trace needs at least one sample")
    arrays = [ids_array(f"routed_experts[{s}]", a) for s, a in enumerate(routed_experts)]
    if moe_layers is not None:
        arrays = [_moe_layers(f"routed_experts[{s}]", a, moe_layers) for s, a in enumerate(arrays)]
    if arrays[0].ndim != 3:
        raise TraceFormatError(
            f"routed_experts[0] must be [seq_len, layer_num, topk], got shape {arrays[0].shape}"
        )
    shape = arrays[0].shape[1:]
    for s, arr in enumerate(arrays):
        if arr.ndim != 3 or arr.shape[1:] != shape:
            raise TraceFormatError(
                f"routed_experts[{s}] has shape {arr.shape}; every sample must be [seq_len, {shape[0]}, "
                f"{shape[1]}] like sample 0"
            )
        _int_ids(f"routed_experts[{s}]", arr, num_experts, "expert ids")
    lens = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    experts = np.concatenate(arrays).astype(np.int16)
    num_layers, top_k = int(shape[0]), int(shape[1])
    derived = {"num_experts": num_experts, "top_k": top_k, "num_layers": num_layers}
    for key, value in derived.items():
        given = (meta or {}).get(key, value)
        if given != value:
            source = "the num_experts argument" if key == "num_experts" else "the routes' shape"
            raise TraceFormatError(
                f"meta[{key!r}]={given!r} contradicts {source} ({key}={value}); leave it out of meta"
            )
    if batch_offsets is not None:
        batch_offsets = np.asarray(batch_offsets)
        _int_ids("batch_offsets", batch_offsets, len(arrays) + 1, "sample offsets")
    if sample_domain is not None:
        sample_domain = np.asarray(sample_domain)
        _int_ids("sample_domain", sample_domain, len(domain_names), "indices into domain_names")
    return RoutingTrace(
        experts=experts,
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=(
            batch_offsets.astype(np.int64) if batch_offsets is not None else _batch_offsets(len(arrays), None)
        ),
        sample_domain=None if sample_domain is None else sample_domain.astype(np.int16),
        domain_names=tuple(domain_names),
        meta={
            "num_experts": num_experts,
            "top_k": top_k,
            "num_layers": num_layers,
            "model": model,
            "source": source,
            **(meta or {}),
        },
    )


SGLANG_DTYPES = {"int32": "<i4", "uint16": "<u2", "uint8": "u1"}
"""Element types of SGLang's base64 ``routed_experts``: int32 today
(``extract_routed_experts_from_meta_info``), uint8 / uint16 by expert count in the narrower encoding."""


def from_sglang(
    routed_experts: Sequence[str | bytes],
    num_layers: int,
    top_k: int,
    num_experts: int,
    dtype: str = "int32",
    **kwargs: Any,
) -> RoutingTrace:
    """A trace from SGLang's ``meta_info.routed_experts``: per sample, base64 of little-endian ids.

    Each string decodes to ``T_s * num_layers * top_k`` values of ``dtype`` (:data:`SGLANG_DTYPES`),
    reshaped to ``[-1, num_layers, top_k]``. A dtype too narrow for ``num_experts`` ids is refused before
    decoding (its ids would have wrapped). Other keyword arguments go to :func:`from_vllm`.
    """
    num_layers = positive_int("num_layers", num_layers)
    top_k = positive_int("top_k", top_k)
    if dtype not in SGLANG_DTYPES:
        raise TraceFormatError(f"dtype must be one of {sorted(SGLANG_DTYPES)}, got {dtype!r}")
    item = np.dtype(SGLANG_DTYPES[dtype])
    if isinstance(num_experts, int) and int(np.iinfo(item).max) < num_experts - 1:
        raise TraceFormatError(
            f"dtype {dtype} holds ids up to {np.iinfo(item).max}, but num_experts={num_experts}: "
            "ids past it were wrapped when they were encoded"
        )
    per_sample = []
    for s, text in enumerate(routed_experts):
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, TypeError, ValueError) as err:
            raise TraceFormatError(f"routed_experts[{s}] is not valid base64 ({err})") from err
        if len(raw) % item.itemsize:
            raise TraceFormatError(
                f"routed_experts[{s}] decodes to {len(raw)} bytes, not a whole number of {dtype} values"
            )
        flat = np.frombuffer(raw, dtype=item)
        if flat.size % (num_layers * top_k):
            raise TraceFormatError(
                f"routed_experts[{s}] decodes to {flat.size} {dtype} values, not a multiple of "
                f"num_layers * top_k = {num_layers * top_k}"
            )
        per_sample.append(flat.reshape(-1, num_layers, top_k))
    kwargs.setdefault("source", "sglang")
    return from_vllm(per_sample, num_experts, **kwargs)


def _moe_layers(name: str, arr: np.ndarray, moe_layers: Sequence[int]) -> np.ndarray:
    """``arr [T, L, k]`` restricted to the layer indices ``moe_layers`` (distinct, in ``[0, L)``)."""
    if arr.ndim != 3:
        raise TraceFormatError(f"{name} must be [seq_len, layer_num, topk], got shape {arr.shape}")
    return select_layers(name, arr, moe_layers)


def from_router_replay(
    samples: Sequence[Sequence[np.ndarray]],
    num_experts: int,
    **kwargs: Any,
) -> RoutingTrace:
    """A trace from per-layer routes (verl R3, Megatron-core ``RouterReplay``).

    Args:
        samples: per sample, a list over the L MoE layers of ``[T_s, k]`` integer arrays (the ids each
            layer's router picked for the sample's tokens).
        num_experts: ``E``. Other keyword arguments go to :func:`from_vllm`.
    """
    per_sample = []
    for s, layers in enumerate(samples):
        arrays = [np.asarray(a) for a in layers]
        if not arrays or any(a.ndim != 2 or a.shape != arrays[0].shape for a in arrays):
            raise TraceFormatError(
                f"samples[{s}] must be a non-empty list of [tokens, topk] arrays of one shape, got "
                f"{[a.shape for a in arrays]}"
            )
        per_sample.append(np.stack(arrays, axis=1))
    kwargs.setdefault("source", "router_replay")
    return from_vllm(per_sample, num_experts, **kwargs)


_OLMOE_ARRAYS = ("layer_index", "generated_token_index", "requested_expert_ids", "sequence_id", "domain_id")
"""The arrays of one OLMoE decode chunk (the traces' README)."""


def load_olmoe_decode(
    directory: str | Path,
    domains: Iterable[str] | None = None,
    samples_per_batch: int | None = None,
) -> RoutingTrace:
    """OLMoE-1B-7B decode chunks (``olmoe-decode/<domain>/sequence_NNNN.npz``) as a trace.

    One sample per prompt (its generated tokens), ordered by ``sequence_id``; each file's rows are sorted
    by ``generated_token_index`` then ``layer_index``. Domains follow the files' ``domain_id``.

    Args:
        directory: the ``olmoe-decode`` folder.
        domains: subset of ``general``, ``coding``, ``math``, ``reasoning`` (default all present).
        samples_per_batch: cut the samples into batches of this many (default one batch).
    """
    root = Path(directory)
    wanted = tuple(domains) if domains is not None else OLMOE_DOMAINS
    files = sorted(f for d in wanted for f in (root / d).glob("sequence_*.npz"))
    if not files:
        raise FileNotFoundError(f"no sequence_*.npz under {root}/{{{','.join(wanted)}}}")
    samples: list[tuple[int, int, np.ndarray]] = []
    num_layers = 0
    for path in files:
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = [k for k in _OLMOE_ARRAYS if k not in z.files]
                if missing:
                    raise TraceFormatError(f"{path}: lacks the arrays {missing} of an OLMoE decode chunk")
                layer = z["layer_index"].astype(np.int64)
                step = z["generated_token_index"].astype(np.int64)
                ids = z["requested_expert_ids"]
                seq, dom = int(z["sequence_id"][0]), int(z["domain_id"][0])
        except TraceFormatError:
            raise
        except (OSError, ValueError, TypeError, IndexError, EOFError, zipfile.BadZipFile) as err:
            raise TraceFormatError(f"{path}: not a readable OLMoE decode chunk ({err})") from err
        num_layers = max(num_layers, int(layer.max()) + 1)
        order = np.lexsort((layer, step))
        num_tokens = np.unique(step).size
        if num_tokens * num_layers != layer.size or not np.array_equal(
            layer[order], np.tile(np.arange(num_layers), num_tokens)
        ):
            raise TraceFormatError(
                f"{path}: rows do not hold every layer of every generated token exactly once"
            )
        samples.append((seq, dom, ids[order].reshape(num_tokens, num_layers, -1)))
    samples.sort(key=lambda item: item[0])
    return from_vllm(
        [s[2] for s in samples],
        num_experts=64,
        model="olmoe-1b-7b",
        source="olmoe-decode",
        batch_offsets=_batch_offsets(len(samples), samples_per_batch),
        sample_domain=np.array([s[1] for s in samples], dtype=np.int16),
        domain_names=OLMOE_DOMAINS,
        meta={"phase": "decode", "sequence_ids": [s[0] for s in samples]},
    )


def _torch_load(path: Path) -> dict[str, Any]:
    import torch  # NOTE: imported here: heavy, and only this format needs it

    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or "indices" not in data:
        raise TraceFormatError(f"{path}: expected a dict with 'indices', got {type(data).__name__}")
    return data


def load_flame_moe(directory: str | Path, samples_per_batch: int | None = None) -> RoutingTrace:
    """FLAME-MoE 290M routing (``flame-moe-290m/``) as a trace (64 experts, top-6).

    ``directory`` is either a folder of per-layer files (``prefill_32seq_x64tok``: 2048 tokens, token
    ``t`` of sequence ``t // sequence_length``) or ``decode_positions`` (subfolders ``1st`` .. ``10th``,
    each the Nth token of 64 sequences; one sample per sequence, its tokens in position order) or the
    ``flame-moe-290m`` root (its prefill folder). Layer files become layers sorted by their label.
    """
    root = Path(directory)
    if (root / "prefill_32seq_x64tok").is_dir():
        root = root / "prefill_32seq_x64tok"
    if root.name == "decode_positions" or (root / "1st").is_dir():
        positions = sorted(
            (p for p in root.iterdir() if p.is_dir()), key=lambda p: int(re.sub(r"\D", "", p.name))
        )
        per_position = [_flame_layers(p) for p in positions]  # each [L, 64, k]
        labels = per_position[0][1]
        if any(lab != labels for _, lab in per_position):
            raise TraceFormatError(f"{root}: decode positions hold different layer sets")
        routes = np.stack([r for r, _ in per_position], axis=2)  # [L, S, P, k]
        num_seq, num_pos = routes.shape[1], routes.shape[2]
        experts = routes.transpose(1, 2, 0, 3).reshape(num_seq * num_pos, len(labels), -1)
        seq_len, phase = num_pos, "decode"
    else:
        routes, labels = _flame_layers(root)  # [L, T, k]
        seq_len = int(_torch_load(next(iter(sorted(root.glob("*.pt")))))["sequence_length"])
        experts = routes.transpose(1, 0, 2)
        num_seq, phase = experts.shape[0] // seq_len, "prefill"
    return from_vllm(
        list(experts.reshape(num_seq, seq_len, len(labels), -1)),
        num_experts=64,
        model="flame-moe-290m",
        source="flame-moe",
        batch_offsets=_batch_offsets(num_seq, samples_per_batch),
        meta={"phase": phase, "layer_labels": labels},
    )


def _flame_layers(folder: Path) -> tuple[np.ndarray, list[int]]:
    """int64 [L, T, k] routes of one folder of layer files, and the sorted layer labels."""
    by_label: dict[int, np.ndarray] = {}
    for path in folder.glob("*.pt"):
        data = _torch_load(path)
        by_label[int(data["layer"])] = data["indices"].numpy()
    if not by_label:
        raise FileNotFoundError(f"no .pt layer files in {folder}")
    labels = sorted(by_label)
    return np.stack([by_label[lab] for lab in labels]), labels


@dataclass(frozen=True)
class IncompleteToken:
    """A token the Mixtral trace records at some layers only."""

    dataset: str
    problem_id: int
    token_idx: int
    missing_layers: tuple[int, ...]


class IncompleteTokensError(ValueError):
    """Tokens miss layers; the ``tokens`` attribute lists them."""

    def __init__(self, tokens: list[IncompleteToken]) -> None:
        self.tokens = tokens
        first = tokens[0]
        super().__init__(
            f"{len(tokens)} tokens miss some layers (first: {first.dataset} problem {first.problem_id} token "
            f"{first.token_idx} misses layers {list(first.missing_layers)}); pass drop_incomplete=True to "
            "drop them and get the list back"
        )


def load_mixtral_jsonl(
    paths: str | Path | Sequence[str | Path],
    drop_incomplete: bool = False,
    num_layers: int = 32,
    num_experts: int = 8,
) -> tuple[RoutingTrace, list[IncompleteToken]]:
    """Mixtral-8x7B JSON lines (one token at one layer per line) as a trace; one sample per problem.

    Samples are ordered by file, then ``problem_id``; tokens by ``token_idx``. A token that misses any of
    the ``num_layers`` layers is never filled in: with ``drop_incomplete=False`` the load raises
    :class:`IncompleteTokensError` listing them; with ``True`` they are dropped and returned.

    Returns:
        (trace, dropped tokens).
    """
    path_list = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    routes: dict[tuple[int, str, int], dict[int, dict[int, list[int]]]] = {}
    top_k = 0
    for f_idx, path in enumerate(path_list):
        with path.open() as handle:
            for n, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    key = (f_idx, str(row["dataset"]), int(row["problem_id"]))
                    token, layer, ids = int(row["token_idx"]), int(row["layer"]), list(row["experts"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                    raise TraceFormatError(f"{path}:{n}: not a routing record ({err})") from err
                top_k = top_k or len(ids)
                if len(ids) != top_k or not 0 <= layer < num_layers:
                    raise TraceFormatError(
                        f"{path}:{n}: expected {top_k} experts at a layer in [0, {num_layers})"
                    )
                routes.setdefault(key, {}).setdefault(token, {})[layer] = ids
    dropped: list[IncompleteToken] = []
    per_sample: list[np.ndarray] = []
    names: list[str] = []
    domains: list[str] = []
    for key in sorted(routes):
        tokens = []
        for token in sorted(routes[key]):
            layers = routes[key][token]
            if len(layers) < num_layers:
                missing = tuple(sorted(set(range(num_layers)) - set(layers)))
                dropped.append(IncompleteToken(key[1], key[2], token, missing))
                continue
            tokens.append([layers[layer] for layer in range(num_layers)])
        if tokens:
            per_sample.append(np.array(tokens, dtype=np.int64))
            names.append(f"{key[1]}/{key[2]}")
            domains.append(key[1])
    if dropped and not drop_incomplete:
        raise IncompleteTokensError(dropped)
    domain_names = tuple(sorted(set(domains)))
    trace = from_vllm(
        per_sample,
        num_experts=num_experts,
        model="mixtral-8x7b",
        source="mixtral-jsonl",
        sample_domain=np.array([domain_names.index(d) for d in domains], dtype=np.int16),
        domain_names=domain_names,
        meta={"phase": "decode", "samples": names, "dropped_tokens": len(dropped)},
    )
    return trace, dropped


def load_olmoe_prefill_counts(directory: str | Path, top_k: int = 8) -> SampleCounts:
    """OLMoE prefill counts (``olmoe-prefill-counts/<domain>.npz``): one sample per request, domains kept.

    Returns:
        :class:`SampleCounts` with counts int32 [S, 16, 64], one batch, in domain order then request order.
    """
    root = Path(directory)
    counts, tokens, domain = [], [], []
    for d, name in enumerate(OLMOE_DOMAINS):
        path = root / f"{name}.npz"
        if not path.exists():
            continue
        with np.load(path, allow_pickle=False) as z:
            c = z["routing_counts"].astype(np.int64)
            t = z["token_counts"].astype(np.int64)
        if not np.array_equal(c.sum(-1), np.broadcast_to(t[:, None] * top_k, c.shape[:2])):
            raise TraceFormatError(f"{path}: 'routing_counts' do not sum to token_counts * top_k={top_k}")
        counts.append(c)
        tokens.append(t)
        domain.append(np.full(t.shape[0], d, dtype=np.int16))
    if not counts:
        raise FileNotFoundError(f"no <domain>.npz of {OLMOE_DOMAINS} in {root}")
    all_counts = np.concatenate(counts)
    return SampleCounts(
        counts=all_counts.astype(np.int32),
        tokens=np.concatenate(tokens),
        batch_offsets=np.array([0, all_counts.shape[0]], dtype=np.int64),
        top_k=top_k,
        sample_domain=np.concatenate(domain),
        domain_names=OLMOE_DOMAINS,
        meta={"model": "olmoe-1b-7b", "source": "olmoe-prefill-counts", "phase": "prefill"},
    )


def load_qwen3_counts(path: str | Path, top_k: int = 8) -> SampleCounts:
    """Qwen3 serving counts (``qwen3-moe-counts/counts*.json``): ``counts[l][e]`` summed over a whole run.

    There is no time dimension, so the result is ONE aggregate sample: counts int32 [1, L, E] with
    ``tokens = layer sum / top_k``.
    """
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(f"{path}: not a regular file (a qwen3-moe-counts counts*.json)")
    try:
        data = json.loads(path.read_text())
        counts = np.rint(np.asarray(data["counts"], dtype=np.float64)).astype(np.int64)
        shape = (int(data["num_layers"]), int(data["num_experts"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError) as err:
        raise TraceFormatError(
            f"{path}: not a qwen3-moe-counts file (needs JSON 'counts' [L][E] numbers, 'num_layers', "
            f"'num_experts'): {type(err).__name__}: {err}"
        ) from err
    if counts.shape != shape:
        raise TraceFormatError(
            f"{path}: 'counts' has shape {counts.shape}, "
            f"but the file says {data['num_layers']} x {data['num_experts']}"
        )
    if counts.size == 0 or (counts < 0).any():
        raise TraceFormatError(f"{path}: 'counts' must be non-empty counts >= 0")
    per_layer = counts.sum(-1)
    tokens = round(float(per_layer.mean()) / top_k)
    model = {94: "qwen3-235b-a22b", 48: "qwen3-30b-a3b"}.get(counts.shape[0], "qwen3")
    return SampleCounts(
        counts=counts[None].astype(np.int32),
        tokens=np.array([tokens], dtype=np.int64),
        batch_offsets=np.array([0, 1], dtype=np.int64),
        top_k=top_k,
        meta={"model": model, "source": "qwen3-moe-counts", "phase": "prefill", "aggregate": True},
    )


# NOTE: imported last: the RL-trainer importers (importers_rl.py) build on from_vllm and the checks above,
# and their public names are importable from here as well.
from relibra.trace.importers_rl import (  # noqa: E402
    fill_route,
    from_areal,
    from_nemo_rl,
    from_skyrl,
    from_slime,
    from_verl,
    join_pipeline_stages,
    moe_layers_from_freq,
)
