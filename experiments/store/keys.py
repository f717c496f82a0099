"""Cell keys: which config values name a grid cell of the results store, and the hash that names it.

``key`` is the first 16 hex digits of the SHA-256 of the canonical JSON of the resolved config, minus the
keys that do not change the numbers (run directory, logger, results directory: :data:`IGNORED_KEYS`). A cell
that reads a trace file is keyed by the file's content, not its path: its config holds the digest of the
trace's arrays (``trace.content_sha256``, :mod:`experiments.store.trace_digest`) and the key leaves the path
out, so a trace replaced at its path gets new cells and a store moved with its trace keeps its cells. Cells
stored before content keys (their config holds the path, no digest: :func:`path_keyed`) or before the peer
trace folder left the key still read as their own key (:func:`stored_keys`). The store's layout and its
guarantees: :mod:`experiments.store.results_store`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "IGNORED_KEYS",
    "TRACE_DIGEST",
    "canonical_config",
    "cell_key",
    "keyed_config",
    "keyed_earlier",
    "path_keyed",
    "stored_keys",
    "stored_under",
    "wall_clock_column",
]

IGNORED_KEYS: frozenset[str] = frozenset(
    {
        "hydra",
        "logger",
        "results_dir",
        "run_dir",
        "output_dir",
        "experiment_name",
        "simulator.memory_check",
        "peer.dir",
    }
)
"""Dotted config paths left out of the cell key: they choose where and how results are written (``peer.dir``:
the folder a peer cell's trace file is written to, under the results root; the trace's content digest keys
the cell), or whether a run that does not fit in memory stops or warns (``simulator.memory_check``), not
what they are."""
_BEFORE_PEER_DIR: frozenset[str] = IGNORED_KEYS - {"peer.dir"}
"""The ignored paths before ``peer.dir`` joined them: a peer cell written then was keyed by its trace
folder too, so a store moved with its traces lost its peer cells. Such a cell still reads as its own key
(:func:`stored_keys`) and is computed again under the current key (:func:`keyed_earlier`)."""


def wall_clock_column(column: str) -> bool:
    """Whether a result column is measured with a wall clock (planner solve times such as ``plan_time_s``,
    a portfolio's ``portfolio_<candidate>_plan_s``, an online balancer's ``<name>_measured_plan_s_per_layer``,
    and the control plane's timings), and so differs between any two runs of the same cell; every other
    column is a pure function of the cell's config and the code."""
    return (
        (column.endswith("_time_s") and column != "step_time_s")
        or (column.startswith("cp_") and column.endswith("_s"))
        or column.endswith("_plan_s")
        or "_plan_s_" in column
    )


def _plain(config: Any) -> Any:
    """A resolved plain-container copy of ``config`` (OmegaConf ``DictConfig`` or any mapping)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf ships with hydra, a core dependency
        return config
    if isinstance(config, DictConfig | ListConfig):
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    return config


def _drop(tree: Any, paths: Iterable[str]) -> Any:
    """Copy of nested dict ``tree`` without the dotted ``paths`` (missing paths are ignored)."""
    if not isinstance(tree, Mapping):
        return tree
    out = {str(k): v for k, v in tree.items()}
    nested: dict[str, list[str]] = {}
    for path in paths:
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, []).append(rest)
        else:
            out.pop(head, None)
    for head, rests in nested.items():
        if head in out:
            out[head] = _drop(out[head], rests)
    return out


TRACE_DIGEST = "content_sha256"
"""Key of ``trace`` in a stored config: the digest of the trace file's arrays
(:func:`experiments.store.trace_digest.trace_digest`), which keys a cell that reads ``trace.path`` in place of
the path."""


def keyed_config(config: Any) -> dict[str, Any]:
    """``config`` as plain data (resolved) with, when it reads a trace file, that file's digest under
    ``trace.content_sha256`` (:data:`TRACE_DIGEST`): the config a cell stores and is keyed by. A config
    that holds the digest already (one read back from a cell) keeps it: the file is not read again."""
    plain = _plain(config)
    if not isinstance(plain, Mapping):
        raise TypeError(f"config must be a mapping or DictConfig, got {type(config).__name__}")
    out = dict(plain)
    trace = out.get("trace")
    if isinstance(trace, Mapping) and trace.get("path") and not trace.get(TRACE_DIGEST):
        from experiments.store.trace_digest import trace_digest

        out["trace"] = {**trace, TRACE_DIGEST: trace_digest(str(trace["path"]))}
    return out


def path_keyed(config: Mapping[str, Any]) -> bool:
    """Whether a stored config was keyed by its trace file's path (by the suite before content keys):
    it reads ``trace.path`` and holds no digest of it."""
    trace = config.get("trace")
    return isinstance(trace, Mapping) and bool(trace.get("path")) and not trace.get(TRACE_DIGEST)


def canonical_config(config: Any, ignored: Iterable[str] = IGNORED_KEYS) -> dict[str, Any]:
    """The part of ``config`` that defines a cell, as plain JSON-able data: :func:`keyed_config`, without
    ``ignored`` and, once the trace's digest stands for its content, without ``trace.path``."""
    keyed = keyed_config(config)
    trace = keyed.get("trace")
    extra = ["trace.path"] if isinstance(trace, Mapping) and trace.get(TRACE_DIGEST) else []
    return _drop(keyed, [*ignored, *extra])


def _hash(tree: Any) -> str:
    text = json.dumps(tree, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cell_key(config: Any, ignored: Iterable[str] = IGNORED_KEYS) -> str:
    """Hash of a cell's resolved config: 16 hex digits of SHA-256 over its canonical JSON.

    Key order, OmegaConf vs plain dicts and the ``ignored`` dotted paths do not change the key; any other
    value does. A cell that reads a trace file is keyed by the digest of the file's arrays, not by its
    path (:func:`canonical_config`), so replacing the file changes the key and moving it does not; a
    config without ``trace.path`` (the synthetic generator) hashes as it always did.
    """
    return _hash(canonical_config(config, ignored))


def stored_keys(config: Mapping[str, Any]) -> frozenset[str]:
    """The keys a cell's stored config may have been written under: :func:`cell_key`, and the keys of the
    suite's earlier rules: the trace folder in the key (``peer.dir``, :data:`_BEFORE_PEER_DIR`) and, for a
    :func:`path_keyed` config, the trace path in the key (before content keys; without reading the file)."""
    if path_keyed(config):
        return frozenset(_hash(_drop(config, ignored)) for ignored in (IGNORED_KEYS, _BEFORE_PEER_DIR))
    return frozenset({cell_key(config), cell_key(config, _BEFORE_PEER_DIR)})


def stored_under(config: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` is one of :func:`stored_keys` of ``config``, the current key tried first (one hash
    for a cell written now: every verified read calls this)."""
    if not path_keyed(config) and key == cell_key(config):
        return True
    return key in stored_keys(config)


def keyed_earlier(config: Mapping[str, Any], key: str) -> bool:
    """Whether a finished cell stored under ``key`` with ``config`` was keyed by an earlier rule of the
    suite (:func:`stored_keys`), so that a grid computes it again under its current key."""
    return path_keyed(config) or key != cell_key(config)
