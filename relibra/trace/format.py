"""Routing traces: the expert every token picks at every MoE layer, and their ``.npz`` file format.

The file format (docs/traces.md, "Routing trace file"; no pickle):

=================  =====================  ============================================================
array              dtype, shape           meaning
=================  =====================  ============================================================
``experts``        int16 ``[T, L, k]``    routed logical expert ids of every token, samples concatenated
``sample_offsets`` int64 ``[S + 1]``      sample ``s`` owns tokens ``sample_offsets[s]:sample_offsets[s+1]``
``batch_offsets``  int64 ``[B + 1]``      batch ``b`` owns samples ``batch_offsets[b]:batch_offsets[b+1]``
                                          (absent: one batch)
``sample_domain``  int16 ``[S]``          optional: index into ``domain_names``
``domain_names``   str ``[D]``            optional: e.g. ``reasoning``, ``coding``
``meta``           str scalar (JSON)      at least ``num_experts``, ``top_k``, ``num_layers``, ``model``,
                                          ``source``
=================  =====================  ============================================================

A malformed trace is refused with :class:`TraceFormatError`, whose message names the array and the problem.
"""

from __future__ import annotations

import json
import os
import stat
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relibra.atomic import atomic_write
from relibra.types import SampleCounts

__all__ = [
    "FORMAT_DOC",
    "MAX_EXPERTS",
    "MAX_META_CHARS",
    "REQUIRED_META",
    "RoutingTrace",
    "TraceFormatError",
    "check_trace",
    "counts_bytes",
    "host_memory_problem",
    "load_trace",
    "positive_int",
    "save_trace",
]

REQUIRED_META = ("num_experts", "top_k", "num_layers", "model", "source")
"""Keys every trace's ``meta`` must hold."""

MAX_EXPERTS = int(np.iinfo(np.int16).max) + 1
"""The most logical experts a trace can hold: ids are int16, so they lie in ``[0, 32767]``."""

MAX_META_CHARS = 1 << 20
"""Longest ``meta`` JSON text read (1 Mi characters): a trace's meta is a handful of keys and at most one id
per sample; a longer one is refused before it is parsed, as JSON nested deeper than Python's recursion
limit would be."""

FORMAT_DOC = "docs/traces.md"
"""Where the file format is described for users (named in refusals)."""

_MAX_KEYS_PER_CHUNK = 1 << 24
"""Routed slots reduced per bincount call in :meth:`RoutingTrace.to_counts` (bounds its memory)."""


class TraceFormatError(ValueError):
    """A routing trace (file or arrays) does not follow the format; the message names the array."""


@dataclass(frozen=True)
class RoutingTrace:
    """Per-token routes of a sequence of samples grouped into batches. Validated on construction."""

    experts: np.ndarray
    """int16 [T, L, k]: routed logical expert ids of every token, samples concatenated in order."""
    sample_offsets: np.ndarray
    """int64 [S + 1]: sample ``s`` owns tokens ``sample_offsets[s]:sample_offsets[s+1]``."""
    batch_offsets: np.ndarray
    """int64 [B + 1]: batch ``b`` owns samples ``batch_offsets[b]:batch_offsets[b+1]``."""
    sample_domain: np.ndarray | None = None
    """int16 [S] or None: index into ``domain_names``."""
    domain_names: tuple[str, ...] = ()
    """[D] domain names (e.g. ``reasoning``, ``coding``)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable; at least ``num_experts``, ``top_k``, ``num_layers``, ``model``, ``source``."""

    def __post_init__(self) -> None:
        check_trace(self)

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def num_samples(self) -> int:
        return int(self.sample_offsets.shape[0] - 1)

    @property
    def num_batches(self) -> int:
        return int(self.batch_offsets.shape[0] - 1)

    @property
    def sample_tokens(self) -> np.ndarray:
        """int64 [S]: tokens of each sample."""
        return np.diff(self.sample_offsets)

    def sample(self, s: int) -> np.ndarray:
        """int16 [T_s, L, k]: the routes of sample ``s``."""
        return self.experts[int(self.sample_offsets[s]) : int(self.sample_offsets[s + 1])]

    def to_counts(self) -> SampleCounts:
        """Per-sample expert counts ``c[s, l, e]`` (a bincount over flattened (sample, layer, expert) keys).

        Reduces the trace in chunks of whole samples so memory stays bounded for long traces.
        """
        num_s, num_l, num_e, k = self.num_samples, self.num_layers, self.num_experts, self.top_k
        counts = np.zeros((num_s, num_l, num_e), dtype=np.int32)
        per_sample_slots = self.sample_tokens * num_l * k
        s0 = 0
        while s0 < num_s:
            # Take whole samples until the chunk holds about _MAX_KEYS_PER_CHUNK routed slots.
            cum = np.cumsum(per_sample_slots[s0:])
            s1 = s0 + max(1, int(np.searchsorted(cum, _MAX_KEYS_PER_CHUNK, side="right")))
            t0, t1 = int(self.sample_offsets[s0]), int(self.sample_offsets[s1])
            local_sample = np.repeat(np.arange(s1 - s0, dtype=np.int64), self.sample_tokens[s0:s1])
            keys = (local_sample[:, None, None] * num_l + np.arange(num_l)[None, :, None]) * num_e
            keys = keys + self.experts[t0:t1].astype(np.int64)
            counts[s0:s1] = np.bincount(keys.ravel(), minlength=(s1 - s0) * num_l * num_e).reshape(
                s1 - s0, num_l, num_e
            )
            s0 = s1
        return SampleCounts(
            counts=counts,
            tokens=self.sample_tokens.astype(np.int64),
            batch_offsets=self.batch_offsets.astype(np.int64),
            top_k=k,
            sample_domain=self.sample_domain,
            domain_names=self.domain_names,
            meta=dict(self.meta),
        )

    def select_samples(self, samples: np.ndarray, batch_offsets: np.ndarray | None = None) -> RoutingTrace:
        """A new trace of the given samples (in that order), regrouped by ``batch_offsets`` (one batch)."""
        idx = np.asarray(samples, dtype=np.int64)
        lens = self.sample_tokens[idx]
        rows = (
            np.concatenate([np.arange(self.sample_offsets[s], self.sample_offsets[s + 1]) for s in idx])
            if idx.size
            else np.zeros(0, dtype=np.int64)
        )
        return RoutingTrace(
            experts=self.experts[rows],
            sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
            batch_offsets=(
                np.asarray(batch_offsets, dtype=np.int64)
                if batch_offsets is not None
                else np.array([0, idx.size], dtype=np.int64)
            ),
            sample_domain=None if self.sample_domain is None else self.sample_domain[idx],
            domain_names=self.domain_names,
            meta=dict(self.meta),
        )


def positive_int(name: str, value: Any, most: int | None = None) -> int:
    """``value`` as an int >= 1 (and <= ``most``), or a :class:`TraceFormatError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TraceFormatError(f"{name} must be a positive integer, got {value!r}")
    if value < 1 or (most is not None and value > most):
        bound = f" and at most {most}" if most is not None else ""
        raise TraceFormatError(f"{name} must be a positive integer{bound}, got {value}")
    return int(value)


def _fail(array: str, problem: str) -> TraceFormatError:
    return TraceFormatError(f"trace array '{array}': {problem}")


def _check_dtype(name: str, arr: Any, dtype: type, ndim: int) -> None:
    if not isinstance(arr, np.ndarray):
        raise _fail(name, f"must be a numpy array, got {type(arr).__name__}")
    if arr.dtype != np.dtype(dtype):
        raise _fail(name, f"dtype must be {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise _fail(name, f"must have rank {ndim}, got shape {arr.shape}")


def _check_offsets(name: str, offsets: np.ndarray, total: int, what: str) -> None:
    if offsets.shape[0] < 2:
        raise _fail(name, f"needs at least 2 entries (one {what}), got {offsets.shape[0]}")
    if offsets[0] != 0:
        raise _fail(name, f"must start at 0, got {offsets[0]}")
    if np.any(np.diff(offsets) <= 0):
        bad = int(np.flatnonzero(np.diff(offsets) <= 0)[0])
        raise _fail(name, f"must be strictly increasing (every {what} non-empty); entry {bad + 1} is not")
    if offsets[-1] != total:
        raise _fail(name, f"must end at {total} to cover all of them, ends at {offsets[-1]}")


def check_trace(trace: RoutingTrace) -> None:
    """Raise :class:`TraceFormatError` unless ``trace`` follows the format (see module doc)."""
    _check_dtype("experts", trace.experts, np.int16, 3)
    _check_dtype("sample_offsets", trace.sample_offsets, np.int64, 1)
    _check_dtype("batch_offsets", trace.batch_offsets, np.int64, 1)
    meta = trace.meta
    if not isinstance(meta, dict):
        raise _fail("meta", f"must be a dict (JSON object), got {type(meta).__name__}")
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise _fail("meta", f"missing required keys {missing} (needs {list(REQUIRED_META)})")
    for key in ("num_experts", "top_k", "num_layers"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 1:
            raise _fail("meta", f"'{key}' must be a positive integer, got {meta[key]!r}")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as err:
        raise _fail("meta", f"must be JSON-serialisable: {err}") from err
    if meta["num_experts"] > MAX_EXPERTS:
        raise _fail(
            "meta",
            f"'num_experts'={meta['num_experts']} does not fit the int16 ids of 'experts' "
            f"(at most {MAX_EXPERTS})",
        )
    num_t, num_l, k = trace.experts.shape
    if meta["top_k"] != k:
        raise _fail("experts", f"has top-k {k} (last axis) but meta says top_k={meta['top_k']}")
    if meta["num_layers"] != num_l:
        raise _fail("experts", f"has {num_l} layers (axis 1) but meta says num_layers={meta['num_layers']}")
    num_e = meta["num_experts"]
    if trace.experts.size:
        lo, hi = int(trace.experts.min()), int(trace.experts.max())
        if lo < 0 or hi >= num_e:
            raise _fail("experts", f"ids must lie in [0, {num_e}) (meta num_experts), found {lo}..{hi}")
    if k > 1 and trace.experts.size:
        ordered = np.sort(trace.experts, axis=-1)
        if np.any(ordered[..., 1:] == ordered[..., :-1]):
            raise _fail("experts", "a token routes to the same expert twice in one layer (top-k is distinct)")
    _check_offsets("sample_offsets", trace.sample_offsets, num_t, "sample")
    num_s = trace.sample_offsets.shape[0] - 1
    _check_offsets("batch_offsets", trace.batch_offsets, num_s, "batch")
    if trace.sample_domain is not None:
        _check_dtype("sample_domain", trace.sample_domain, np.int16, 1)
        if trace.sample_domain.shape[0] != num_s:
            raise _fail(
                "sample_domain",
                f"must have one entry per sample ({num_s}), got {trace.sample_domain.shape[0]}",
            )
        num_d = len(trace.domain_names)
        if trace.sample_domain.size and (trace.sample_domain.min() < 0 or trace.sample_domain.max() >= num_d):
            raise _fail("sample_domain", f"indices must lie in [0, {num_d}) (len(domain_names))")
    if not all(isinstance(name, str) for name in trace.domain_names):
        raise _fail("domain_names", "must be a tuple of strings")


def save_trace(trace: RoutingTrace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` to ``path`` (``.npz``, no pickle) atomically (:func:`relibra.atomic.atomic_write`)."""
    check_trace(trace)
    arrays: dict[str, np.ndarray] = {
        "experts": trace.experts,
        "sample_offsets": trace.sample_offsets,
        "batch_offsets": trace.batch_offsets,
        "meta": np.array(json.dumps(trace.meta, sort_keys=True)),
    }
    if trace.sample_domain is not None:
        arrays["sample_domain"] = trace.sample_domain
    if trace.domain_names:
        arrays["domain_names"] = np.array(trace.domain_names, dtype=str)
    return atomic_write(path, lambda handle: np.savez(handle, **arrays), ".npz")  # type: ignore[arg-type]


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
"""First bytes of a zip archive (an ``.npz``): a local file header, or the end record of an empty archive."""

# NOTE: what numpy and zipfile raise for a damaged archive or member: a truncated zip (BadZipFile), a
# member cut short (EOFError, zlib.error is an Exception subclass raised as such), a bad .npy header
# (ValueError), an unreadable file (OSError).
_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def host_memory_problem(what: str, need: int) -> str | None:
    """Why ``need`` bytes for ``what`` cannot be held by this host: more than the kernel's ``MemAvailable``
    (:func:`relibra.executors.budget.available_host_bytes`); None when they fit or the host does not
    publish it (not Linux: no check)."""
    from relibra.executors import budget

    available = budget.available_host_bytes()
    if available is None or need <= available:
        return None
    return (
        f"{what} need {need / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB this host has "
        "available (MemAvailable)"
    )


def counts_bytes(num_samples: int, num_layers: int, num_experts: int) -> int:
    """Bytes of the per-sample counts ``[S, L, E]`` int32 (:class:`SampleCounts`) of such a trace: what
    :meth:`RoutingTrace.to_counts` and the synthetic generator allocate, a lower bound on a run's input."""
    return int(num_samples) * int(num_layers) * int(num_experts) * np.dtype(np.int32).itemsize


def _check_declared_size(archive: zipfile.ZipFile, key: str, path: str | os.PathLike[str]) -> int:
    """Refuse member ``key`` whose ``.npy`` header declares more bytes than the member holds, before numpy
    allocates them (a forged header could ask for terabytes). Returns the bytes it declares."""
    try:
        info = archive.getinfo(f"{key}.npy")
    except KeyError:
        return 0  # NOTE: a member without the .npy suffix: numpy reads it as it is, nothing is declared
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            header_reader = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if header_reader is None:
                return 0  # NOTE: a newer header version: numpy's own reader checks it
            shape, _, dtype = header_reader(member, max_header_size=10_000)
            offset = member.tell()
    except _READ_ERRORS as err:
        raise _fail(key, f"in {path} has no readable .npy header ({type(err).__name__}: {err})") from err
    if dtype.hasobject:
        return 0  # NOTE: refused as needing pickle when it is read
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if declared > info.file_size - offset:
        raise _fail(
            key,
            f"in {path} declares shape {tuple(shape)} of {dtype} ({declared} bytes) but the member holds "
            f"{info.file_size - offset} bytes",
        )
    return declared


def load_trace(path: str | os.PathLike[str]) -> RoutingTrace:
    """Read and validate a trace file; raises :class:`TraceFormatError` naming the bad array.

    Every way a file can be unreadable (missing, empty, not a zip, truncated, a member that needs pickle
    or is cut short) is a :class:`TraceFormatError` too, naming the file and, where one is at fault, the
    array.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # NOTE: a device or a FIFO would be read without end
            raise TraceFormatError(f"trace file {path}: not a regular file (a trace is an .npz archive)")
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as err:
        raise TraceFormatError(f"trace file {path}: cannot be read ({err.strerror or err})") from err
    if not head:
        raise TraceFormatError(f"trace file {path}: is empty (0 bytes); a trace is an .npz (zip) archive")
    if head not in _ZIP_MAGIC:
        raise TraceFormatError(
            f"trace file {path}: not an .npz (zip) archive (it starts with {head!r}, a zip with b'PK')"
        )
    try:
        npz = np.load(path, allow_pickle=False)
    except _READ_ERRORS as err:
        raise TraceFormatError(f"trace file {path}: not a readable .npz archive ({err})") from err
    with npz:
        for key in ("experts", "sample_offsets", "meta"):
            if key not in npz.files:
                raise _fail(key, f"missing from {path} (it holds {sorted(npz.files)})")
        declared = {key: _check_declared_size(npz.zip, key, path) for key in npz.files}
        if why := host_memory_problem(f"trace file {path}: its arrays", sum(declared.values())):
            raise TraceFormatError(
                f"{why}; {', '.join(f'{k} {v / 2**30:.1f} GiB' for k, v in declared.items())}"
            )
        arrays = {}
        for key in npz.files:
            try:
                arrays[key] = npz[key]
            except ValueError as err:
                if "pickle" in str(err):
                    raise _fail(key, f"in {path} needs pickle to load ({err})") from err
                raise _fail(key, f"in {path} is not a readable .npy member ({err})") from err
            except _READ_ERRORS as err:
                raise _fail(key, f"in {path} is damaged or truncated ({type(err).__name__}: {err})") from err
    meta_arr = arrays["meta"]
    if meta_arr.ndim != 0 or meta_arr.dtype.kind != "U":
        raise _fail(
            "meta", f"must be a str scalar holding JSON, got dtype {meta_arr.dtype} shape {meta_arr.shape}"
        )
    text = str(meta_arr)
    if len(text) > MAX_META_CHARS:
        raise _fail("meta", f"is {len(text)} characters long; at most {MAX_META_CHARS} are read")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as err:
        raise _fail("meta", f"is not valid JSON ({err})") from err
    except RecursionError as err:
        raise _fail("meta", "is JSON nested too deeply to read") from err
    if not isinstance(meta, dict):
        raise _fail("meta", f"must hold a JSON object, got {type(meta).__name__}")
    sample_offsets = arrays["sample_offsets"]
    batch_offsets = arrays.get("batch_offsets")
    if batch_offsets is None:
        _check_dtype("sample_offsets", sample_offsets, np.int64, 1)
        batch_offsets = np.array([0, max(sample_offsets.shape[0] - 1, 0)], dtype=np.int64)
    names = arrays.get("domain_names")
    if names is not None and (names.ndim != 1 or names.dtype.kind != "U"):
        raise _fail("domain_names", f"must be a 1-D str array, got dtype {names.dtype} shape {names.shape}")
    return RoutingTrace(
        experts=arrays["experts"],
        sample_offsets=sample_offsets,
        batch_offsets=batch_offsets,
        sample_domain=arrays.get("sample_domain"),
        domain_names=tuple(str(n) for n in names) if names is not None else (),
        meta=meta,
    )
