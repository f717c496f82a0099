"""Resumable results store: one parquet file per grid cell, keyed by a hash of the cell's resolved config.

An experiment directory (the run config's ``results_dir``, e.g. ``results/quick_overall``) looks like::

    <results_dir>/
        cells/<key>.parquet        the cell's result rows (DESIGN.md result columns); the resolved config
                                   is kept as JSON in the parquet schema metadata
        per_layer/<key>.parquet    optional per-(planner, micro-batch, layer) table (skew heatmaps)
        grid.json                  optional: the keys of the experiment's current grid

``key`` is the first 16 hex digits of the SHA-256 of the canonical JSON of the resolved config, minus the
keys that do not change the numbers (run directory, logger, results directory: ``IGNORED_KEYS``).

Atomicity: every file is written to a unique temporary name (``.tmp-*``) in its final directory, flushed
and fsynced, then moved into place with ``os.replace`` (atomic on POSIX within one file system). The
per-layer file is written before the cell file, so a cell is finished exactly when ``cells/<key>.parquet``
exists, and a finished cell always has its per-layer table if it has one. Two writers of the same cell
both write complete files and the last rename wins; readers see either no file or a whole one. A crashed
writer leaves only a ``.tmp-*`` file, which readers ignore and a rerun redoes.

When a preset or a planner's config changes, its cells get new keys and the old cells stay on disk. A
driver that knows the grid (``experiments.reproduce``) writes ``grid.json``; loading then returns only
the grid's finished cells (``all_cells=True`` returns every cell on disk).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "IGNORED_KEYS",
    "UNKNOWN_CODE",
    "ResultsStore",
    "cell_key",
    "load_experiment",
    "load_per_layer",
    "run_cell",
    "stored_code_version",
]

IGNORED_KEYS: frozenset[str] = frozenset(
    {"hydra", "logger", "results_dir", "run_dir", "output_dir", "experiment_name"}
)
"""Dotted config paths left out of the cell key: they choose where and how results are written, not what
they are."""

_CONFIG_META = b"relibra.config"
_KEY_META = b"relibra.cell"
_TMP_PREFIX = ".tmp-"


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


def canonical_config(config: Any, ignored: Iterable[str] = IGNORED_KEYS) -> dict[str, Any]:
    """The part of ``config`` that defines a cell, as plain JSON-able data (resolved, ``ignored`` removed)."""
    plain = _plain(config)
    if not isinstance(plain, Mapping):
        raise TypeError(f"config must be a mapping or DictConfig, got {type(config).__name__}")
    return _drop(plain, ignored)


def cell_key(config: Any, ignored: Iterable[str] = IGNORED_KEYS) -> str:
    """Hash of a cell's resolved config: 16 hex digits of SHA-256 over its canonical JSON.

    Key order, OmegaConf vs plain dicts and the ``ignored`` dotted paths do not change the key; any other
    value does.
    """
    text = json.dumps(canonical_config(config, ignored), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fsync_dir(directory: Path) -> None:
    # NOTE: makes the rename itself durable across a power loss; not all file systems allow opening a
    # directory, so a failure here is not an error (the rename is still atomic for other processes).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[BinaryIO], object], suffix: str) -> None:
    """Write ``path`` through ``write(file)`` so no reader ever sees a partial file (temp, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=suffix, dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _read_table(path: Path) -> pa.Table:
    """Read a parquet file from ONE open of ``path``.

    NOTE: ``pd.read_parquet(path)`` may open the path more than once (footer, then row groups); if a
    concurrent writer renames a new version into place in between, the reader mixes two files ("Page was
    smaller than expected"). Reading the bytes through one file handle pins one inode, so a reader sees
    exactly one whole version.
    """
    with open(path, "rb") as fh:
        return pq.read_table(pa.BufferReader(fh.read()))


def atomic_write_parquet(
    frame: pd.DataFrame, path: Path, metadata: Mapping[bytes, bytes] | None = None
) -> None:
    """Write ``frame`` to ``path`` atomically, with ``metadata`` added to the parquet schema metadata."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    _atomic_write(path, lambda fh: pq.write_table(table, fh), ".parquet")


@dataclass(frozen=True)
class ResultsStore:
    """The finished cells of one experiment, under ``root`` (see the module docstring for the layout)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def cells_dir(self) -> Path:
        return self.root / "cells"

    @property
    def per_layer_dir(self) -> Path:
        return self.root / "per_layer"

    def cell_path(self, key: str) -> Path:
        return self.cells_dir / f"{key}.parquet"

    def per_layer_path(self, key: str) -> Path:
        return self.per_layer_dir / f"{key}.parquet"

    def has(self, key: str) -> bool:
        """Whether cell ``key`` is finished (its cell file exists; it is only ever written whole)."""
        return self.cell_path(key).is_file()

    def keys(self) -> list[str]:
        """Keys of all finished cells, sorted."""
        if not self.cells_dir.is_dir():
            return []
        return sorted(p.stem for p in self.cells_dir.glob("*.parquet") if not p.name.startswith(_TMP_PREFIX))

    def write(
        self,
        key: str,
        results: pd.DataFrame,
        config: Any,
        per_layer: pd.DataFrame | None = None,
    ) -> Path:
        """Store cell ``key``: its result rows, its config (JSON in the metadata) and its per-layer table.

        The per-layer table goes first, so the cell file (which marks the cell finished) appears last.
        Returns the cell file's path.
        """
        if results.empty:
            raise ValueError(
                f"cell {key}: refusing to store an empty results frame (a finished cell has rows)"
            )
        meta = {
            _KEY_META: key.encode(),
            _CONFIG_META: json.dumps(_plain(config), sort_keys=True, default=str).encode(),
        }
        if per_layer is not None:
            atomic_write_parquet(per_layer, self.per_layer_path(key), {_KEY_META: key.encode()})
        path = self.cell_path(key)
        atomic_write_parquet(results, path, meta)
        return path

    def read(self, key: str) -> pd.DataFrame:
        """Result rows of finished cell ``key``."""
        path = self.cell_path(key)
        if not path.is_file():
            raise FileNotFoundError(f"cell {key} is not finished in {self.root} (no {path})")
        return _read_table(path).to_pandas()

    def read_per_layer(self, key: str) -> pd.DataFrame | None:
        """Per-layer table of cell ``key``, or None when the cell stored none."""
        path = self.per_layer_path(key)
        return _read_table(path).to_pandas() if path.is_file() else None

    def config(self, key: str) -> dict[str, Any]:
        """The resolved config cell ``key`` was run with."""
        meta = _read_table(self.cell_path(key)).schema.metadata or {}
        return json.loads(meta[_CONFIG_META])

    @property
    def grid_path(self) -> Path:
        return self.root / "grid.json"

    def write_grid(self, keys: Iterable[str]) -> None:
        """Record the keys of the experiment's current grid (atomically), so loads skip stale cells."""
        text = json.dumps(sorted(set(keys))).encode()
        _atomic_write(self.grid_path, lambda fh: fh.write(text), ".json")

    def current_keys(self, all_cells: bool = False) -> list[str]:
        """Finished cells of the current grid (``grid.json``), or every finished cell without one."""
        done = self.keys()
        if all_cells or not self.grid_path.is_file():
            return done
        grid = set(json.loads(self.grid_path.read_text()))
        return [k for k in done if k in grid]

    def load(self, all_cells: bool = False) -> pd.DataFrame:
        """Finished cells' rows in one frame, with a ``cell`` column holding each row's key.

        Only the current grid's cells when ``grid.json`` exists, unless ``all_cells``.
        """
        frames = [self.read(k).assign(cell=k) for k in self.current_keys(all_cells)]
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"cell": []})

    def load_per_layer(self, all_cells: bool = False) -> pd.DataFrame:
        """Finished cells' per-layer tables in one frame, with a ``cell`` column (grid rule as ``load``)."""
        frames = []
        for k in self.current_keys(all_cells):
            table = self.read_per_layer(k)
            if table is not None:
                frames.append(table.assign(cell=k))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"cell": []})

    def clean_stale(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files left by crashed writers older than ``older_than_s``; returns how many."""
        now = time.time()
        removed = 0
        for directory in (self.cells_dir, self.per_layer_dir):
            if not directory.is_dir():
                continue
            for tmp in directory.glob(f"{_TMP_PREFIX}*"):
                try:
                    if now - tmp.stat().st_mtime > older_than_s:
                        tmp.unlink()
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed


UNKNOWN_CODE = "unknown"
"""``code_version`` of a cell stored without one (by code older than the column)."""


def stored_code_version(results: pd.DataFrame) -> str:
    """The ``code_version`` a cell's result rows were computed by (:data:`UNKNOWN_CODE` if not recorded)."""
    if "code_version" not in results.columns or results.empty:
        return UNKNOWN_CODE
    versions = sorted(set(results["code_version"].astype(str)))
    return versions[0] if len(versions) == 1 else ",".join(versions)


def run_cell(
    store: ResultsStore,
    config: Any,
    compute: Callable[[], tuple[pd.DataFrame, pd.DataFrame | None]],
    recompute: bool = False,
) -> tuple[pd.DataFrame, bool]:
    """Results of the cell ``config``: read back when finished, else ``compute()``-d and stored.

    ``compute`` returns ``(results, per_layer or None)``. Returns ``(results, reused)`` where ``reused`` says
    the cell was already finished and nothing ran. ``recompute``: compute even a finished cell; its stored
    rows are replaced only once the new ones are written (atomically).
    """
    key = cell_key(config)
    if store.has(key) and not recompute:
        return store.read(key), True
    results, per_layer = compute()
    store.write(key, results, config, per_layer)
    return results, False


def load_experiment(results_dir: str | Path, all_cells: bool = False) -> pd.DataFrame:
    """One experiment's finished cells as a frame (one row per planner run, plus a ``cell`` column).

    Only the cells of its current grid when the experiment has a ``grid.json``, unless ``all_cells``.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results directory {root} does not exist (run the experiment first)")
    return ResultsStore(root).load(all_cells)


def load_per_layer(results_dir: str | Path) -> pd.DataFrame:
    """One experiment's per-layer tables (empty frame with a ``cell`` column when there are none)."""
    return ResultsStore(Path(results_dir)).load_per_layer()
