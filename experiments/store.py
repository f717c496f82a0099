"""Resumable results store: one parquet file per grid cell, keyed by a hash of the cell's resolved config.

An experiment directory (the run config's ``results_dir``, e.g. ``results/quick_overall``) looks like::

    <results_dir>/
        cells/<key>.parquet        the cell's result rows (docs/spine.md, "Result columns"); its key, resolved
                                   config (JSON) and content checksum in the parquet schema metadata
        per_layer/<key>.parquet    optional per-(planner, micro-batch, layer) table (skew heatmaps), with
                                   its key and checksum likewise
        claims/<key>.lock          the lock a writer holds while it computes the cell
        grid.json                  optional: the keys of the experiment's current grid
        claims/grid.json.lock      the lock a writer holds while it rewrites grid.json

``key`` is the first 16 hex digits of the SHA-256 of the canonical JSON of the resolved config, minus the
keys that do not change the numbers (run directory, logger, results directory: ``IGNORED_KEYS``). A cell
that reads a trace file is keyed by the file's content, not its path: its config holds the digest of the
trace's arrays (``trace.content_sha256``, :mod:`experiments.trace_digest`) and the key leaves the path out,
so a trace replaced at its path gets new cells and a store moved with its trace keeps its cells. Cells
stored before content keys (their config holds the path, no digest: :func:`path_keyed`) still read as their
own key; a grid wants them under content keys, so they are computed once more (``reproduce`` says so).

Atomicity: every file is written by :func:`relibra.atomic.atomic_write` (a unique ``.tmp-*`` name in its
final directory, fsync, ``os.replace``). The per-layer file is written before the cell file, so a cell is
finished exactly when ``cells/<key>.parquet`` exists, and a finished cell always has its per-layer table
if it has one. A crashed writer leaves only a ``.tmp-*`` file, which readers ignore, a rerun redoes and
:meth:`ResultsStore.clean_stale` (run by every :func:`run_cell`) removes once it is an hour old.

Concurrent writers: :func:`run_cell` computes a cell only under :meth:`ResultsStore.claim` and looks it up
again once the claim is held, so a cell is computed once however many sweeps reach it.

Verified reads: every read of a cell (and of its per-layer table) checks, from the file's own metadata,
that it is the file of the cell asked for (``relibra.cell`` equals the key in its name: a file copied or
moved over another cell's is refused), that its stored config hashes to that key (:func:`cell_key`), and
that its rows hash to the stored ``relibra.checksum`` (:func:`content_checksum`: SHA-256 over the column
names and pandas' per-row hashes, so a flipped bit in a page that parquet still decodes is found). A cell
file that fails any check, cannot be read as parquet, or is not a file (a directory at its path) raises
:class:`CorruptCellError` naming it and what failed; :meth:`ResultsStore.finished` (the one way the suite
decides whether to compute) counts it as missing, so it is recomputed and replaced. A cell written before
checksums existed fails the check the same way ("no content checksum"): it is recomputed once, with that
message, rather than trusted unverified. The format stays plain parquet: ``pd.read_parquet`` reads a cell.

When a preset or a planner's config changes, its cells get new keys and the old cells stay on disk. A
driver that knows the grid (``experiments.reproduce``) writes ``grid.json``; loading then returns only
the grid's finished cells (``all_cells=True`` returns every cell on disk). A run whose overrides narrow
the preset's sweep (``seed=1,2``) records only its own cells unless asked to extend the grid
(``experiments.reproduce --extend-grid``); the runner says how many finished cells the new grid leaves out.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from relibra.atomic import TMP_PREFIX, atomic_write

__all__ = [
    "IGNORED_KEYS",
    "TRACE_DIGEST",
    "UNKNOWN_CODE",
    "CorruptCellError",
    "GridFileError",
    "ResultsStore",
    "StoreContents",
    "cell_key",
    "content_checksum",
    "keyed_config",
    "load_experiment",
    "load_per_layer",
    "path_keyed",
    "run_cell",
    "stored_code_version",
    "wall_clock_column",
]

IGNORED_KEYS: frozenset[str] = frozenset(
    {"hydra", "logger", "results_dir", "run_dir", "output_dir", "experiment_name", "simulator.memory_check"}
)
"""Dotted config paths left out of the cell key: they choose where and how results are written, or whether
a run that does not fit in memory stops or warns (``simulator.memory_check``), not what they are."""


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


_CONFIG_META = b"relibra.config"
_KEY_META = b"relibra.cell"
_CHECKSUM_META = b"relibra.checksum"
_PER_LAYER_META = b"relibra.per_layer"
"""In a cell file: the content checksum of the per-layer table written with it (empty: it has none).
Cells written before this key existed say nothing about theirs."""
_TMP_PREFIX = TMP_PREFIX
_GRID_CLAIM = "grid.json"
"""The claim (``claims/grid.json.lock``) under which ``grid.json`` is read and rewritten; no cell key
(16 hex digits) takes this name."""

log = logging.getLogger(__name__)


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
(:func:`experiments.trace_digest.trace_digest`), which keys a cell that reads ``trace.path`` in place of
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
        from experiments.trace_digest import trace_digest

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


def _stored_key(config: Mapping[str, Any]) -> str:
    """The key a cell's stored config was written under: :func:`cell_key`, or for a :func:`path_keyed`
    config the key of the suite before content keys (its path in the hash), without reading the file."""
    if path_keyed(config):
        return _hash(_drop(config, IGNORED_KEYS))
    return cell_key(config)


class GridFileError(ValueError):
    """A store's ``grid.json`` is there but holds no list of cell keys; names the file and the problem."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(
            f"{path}: {reason}; a run of its preset that does not extend the grid (python -m "
            "experiments.reproduce without --extend-grid) writes it anew, or delete it to read every cell "
            "on disk"
        )

    def __reduce__(self) -> tuple[type, tuple[Path, str]]:  # NOTE: raised in a planning worker process
        return (type(self), (self.path, self.reason))


class CorruptCellError(ValueError):
    """A store file exists but cannot be trusted: unreadable as parquet (truncated, overwritten), not a file,
    another cell's file, or content that does not match its checksum (bit rot); names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        super().__init__(f"{path}: corrupt store file ({reason}); it counts as missing and is recomputed")


def content_checksum(frame: pd.DataFrame) -> str:
    """SHA-256 (hex) of a frame's content: its column names in order, then pandas' hash of every row
    (``pd.util.hash_pandas_object``, index left out), so equal rows read back from parquet hash equal."""
    digest = hashlib.sha256(json.dumps([str(c) for c in frame.columns]).encode())
    if len(frame):
        digest.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    return digest.hexdigest()


def _read_table(path: Path) -> pa.Table:
    """Read a parquet file from ONE open of ``path``; :class:`CorruptCellError` naming it if unreadable.

    NOTE: ``pd.read_parquet(path)`` may open the path more than once (footer, then row groups); if a
    concurrent writer renames a new version into place in between, the reader mixes two files ("Page was
    smaller than expected"). Reading the bytes through one file handle pins one inode, so a reader sees
    exactly one whole version. The price is that pyarrow sees a buffer, not the path, so its errors are
    re-raised here with the path.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except IsADirectoryError as err:
        raise CorruptCellError(path, "a directory, not a parquet file") from err
    try:
        return pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as err:
        raise CorruptCellError(path, f"{type(err).__name__}: {err}") from err


def atomic_write_parquet(
    frame: pd.DataFrame, path: Path, metadata: Mapping[bytes, bytes] | None = None
) -> None:
    """Write ``frame`` to ``path`` atomically, with ``metadata`` added to the parquet schema metadata."""
    table = pa.Table.from_pandas(frame, preserve_index=False)
    if metadata:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    atomic_write(path, lambda fh: pq.write_table(table, fh), ".parquet")


def _verified(path: Path, key: str, table: pa.Table, has_config: bool) -> pd.DataFrame:
    """``table`` (read from ``path``, the file of cell ``key``) as a frame, once its metadata says it is that
    cell's file (``relibra.cell``), its rows match ``relibra.checksum`` and (``has_config``) its stored config
    hashes to ``key``; :class:`CorruptCellError` naming what failed otherwise (module docstring)."""
    return _verified_with_config(path, key, table, has_config)[0]


def _verified_with_config(
    path: Path, key: str, table: pa.Table, has_config: bool
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """:func:`_verified`'s frame and the stored config it checked (``{}`` without ``has_config``)."""
    meta = table.schema.metadata or {}
    stored_key = meta.get(_KEY_META, b"").decode(errors="replace")
    if stored_key != key:
        raise CorruptCellError(
            path, f"it holds cell {stored_key or '(none recorded)'}, not {key}: another cell's file was "
            "copied or moved over it",
        )  # fmt: skip
    if _CHECKSUM_META not in meta:
        raise CorruptCellError(
            path, "no content checksum: written by a version of the suite before checksums"
        )
    try:  # NOTE: a damaged pandas schema entry (JSON in the metadata) fails here, before the checksum
        frame = table.to_pandas()
    except (pa.ArrowException, KeyError, TypeError, ValueError) as err:
        raise CorruptCellError(path, f"its pandas metadata is damaged ({type(err).__name__}: {err})") from err
    if content_checksum(frame) != meta[_CHECKSUM_META].decode(errors="replace"):
        raise CorruptCellError(path, "its rows do not match their checksum (damaged or edited)")
    if has_config:
        try:
            config = json.loads(meta[_CONFIG_META])
        except (KeyError, ValueError) as err:
            raise CorruptCellError(path, f"its stored config is missing or not JSON ({err})") from err
        if not isinstance(config, dict) or _stored_key(config) != key:
            raise CorruptCellError(path, f"its stored config does not hash to its key {key}")
        return frame, config
    return frame, {}


def _remove_non_file(path: Path) -> None:
    """Remove whatever that is not a file occupies a store file's path (a directory: a corrupt cell)."""
    if path.is_dir() and not path.is_symlink():
        log.warning("%s is a directory, not a cell file: removing it to store the cell", path)
        shutil.rmtree(path)


def _drop_unheld(path: Path, handle: Any) -> None:
    """Close ``handle`` on ``path``, removing the file if no other process holds its lock (a claim given
    up while being taken; a file another writer holds is left to it)."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
            path.unlink(missing_ok=True)
    except OSError:
        pass  # held by another writer, already removed, or no locks on this file system
    finally:
        handle.close()


@dataclass(frozen=True)
class StoreContents:
    """What one read of a store's current cells found (:meth:`ResultsStore.contents`)."""

    rows: pd.DataFrame
    """Every finished, readable cell's rows with a ``cell`` column (:meth:`ResultsStore.load`'s frame)."""
    configs: dict[str, dict[str, Any]]
    """Cell key -> the resolved config it ran with, for each cell in ``rows``."""
    corrupt: list[str]
    """Keys whose cell file exists but cannot be read or trusted (left out of ``rows``, each logged)."""
    unfinished: list[str]
    """Keys of the recorded grid (``grid.json``) with no cell file: an interrupted or running grid (empty
    without a ``grid.json``, or with ``all_cells``)."""
    lost_per_layer: list[str] = field(default_factory=list)
    """Keys in ``rows`` whose cell file records a per-layer table that is missing (a rerun of the grid
    recomputes them; until then no per-layer figure of the store can be whole)."""


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
        """Whether cell ``key``'s file exists (written only whole; :meth:`finished` also checks it reads)."""
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
        """Store cell ``key``: its result rows, its config (JSON in the metadata) and its per-layer table,
        each file with its key and content checksum (module docstring, "Verified reads").

        The per-layer table goes first, so the cell file (which marks the cell finished) appears last.
        Returns the cell file's path. Raises ValueError for empty rows or a ``key`` that is not
        ``cell_key(config)``.
        """
        if results.empty:
            raise ValueError(
                f"cell {key}: refusing to store an empty results frame (a finished cell has rows)"
            )
        if cell_key(config) != key:
            raise ValueError(f"cell {key}: its config hashes to {cell_key(config)}, not to its key")
        meta = {
            _KEY_META: key.encode(),
            _CONFIG_META: json.dumps(keyed_config(config), sort_keys=True, default=str).encode(),
            _CHECKSUM_META: content_checksum(results).encode(),
        }
        meta[_PER_LAYER_META] = b""
        if per_layer is not None:
            layer_meta = {_KEY_META: key.encode(), _CHECKSUM_META: content_checksum(per_layer).encode()}
            meta[_PER_LAYER_META] = layer_meta[_CHECKSUM_META]
            _remove_non_file(self.per_layer_path(key))
            atomic_write_parquet(per_layer, self.per_layer_path(key), layer_meta)
        else:  # NOTE: an earlier computation's table would pass for this one's
            self.per_layer_path(key).unlink(missing_ok=True)
        path = self.cell_path(key)
        _remove_non_file(path)
        atomic_write_parquet(results, path, meta)
        return path

    def read(self, key: str) -> pd.DataFrame:
        """Result rows of finished cell ``key``.

        Raises FileNotFoundError when the cell is not finished and :class:`CorruptCellError` (naming the
        file and the check it failed) when its file cannot be read or trusted (module docstring).
        """
        return self.read_with_config(key)[0]

    def read_with_config(self, key: str) -> tuple[pd.DataFrame, dict[str, Any]]:
        """:meth:`read`'s rows and the resolved config the cell was run with, from one read of its file.

        A cell whose file records a per-layer table that is no longer there is not finished: this raises
        :class:`CorruptCellError` naming the missing file (so :meth:`finished` counts the cell missing and
        a rerun restores both)."""
        rows, config, lost = self._read_cell(key)
        if lost:
            raise CorruptCellError(self.per_layer_path(key), lost)
        return rows, config

    def _read_cell(self, key: str) -> tuple[pd.DataFrame, dict[str, Any], str | None]:
        """Rows and config of cell ``key`` (verified) and why its recorded per-layer table is lost (None:
        it is there, or the cell records none)."""
        path = self.cell_path(key)
        try:
            table = _read_table(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"cell {key} is not finished in {self.root} (no {path})") from None
        rows, config = _verified_with_config(path, key, table, has_config=True)
        recorded = (table.schema.metadata or {}).get(_PER_LAYER_META, b"")
        if not recorded:
            return rows, config, None
        layer_path = self.per_layer_path(key)
        if not layer_path.is_file():
            return rows, config, f"the per-layer table of cell {key} is missing (its cell file records one)"
        try:  # NOTE: the footer only; read_per_layer checks the rows against it
            held = (pq.read_schema(layer_path).metadata or {}).get(_CHECKSUM_META)
        except (OSError, pa.ArrowException) as err:
            return rows, config, f"the per-layer table of cell {key} cannot be read ({err})"
        if held != recorded:
            return rows, config, f"the per-layer table of cell {key} is not the one its cell file records"
        return rows, config, None

    def finished(self, key: str) -> pd.DataFrame | None:
        """Rows of cell ``key`` when it is finished and readable, else None: the one way the suite decides
        whether a cell must be computed. An unreadable cell file is logged (naming it) and counts as
        missing, so the next run of its grid recomputes it and the atomic write replaces it."""
        try:
            return self.read(key)
        except FileNotFoundError:
            return None
        except CorruptCellError as err:
            log.warning("%s", err)
            return None

    def read_per_layer(self, key: str) -> pd.DataFrame | None:
        """Per-layer table of cell ``key``, or None when the cell stored none; :class:`CorruptCellError`
        when its file cannot be read or trusted (the same checks as :meth:`read`, without a config), or is
        not the table the cell file records (a recompute stopped between writing the two)."""
        path = self.per_layer_path(key)
        if not path.exists():
            return None
        table = _read_table(path)
        frame = _verified(path, key, table, has_config=False)
        recorded = self._recorded_per_layer(key)
        if recorded and recorded != (table.schema.metadata or {}).get(_CHECKSUM_META):
            raise CorruptCellError(
                path, "it is not the per-layer table its cell file records (another computation's)"
            )
        return frame

    def _recorded_per_layer(self, key: str) -> bytes | None:
        """The per-layer checksum cell ``key``'s file records (its footer only); None when it records
        none or cannot be read (the cell's own read reports that)."""
        try:
            return (pq.read_schema(self.cell_path(key)).metadata or {}).get(_PER_LAYER_META)
        except (OSError, pa.ArrowException):
            return None

    def corrupt_keys(self, all_cells: bool = False) -> list[str]:
        """Cells whose file exists but cannot be read or trusted (:meth:`load` leaves them out)."""
        return self.contents(all_cells).corrupt

    @contextmanager
    def claim(self, key: str) -> Iterator[None]:
        """Hold the claim on cell ``key`` (an exclusive ``flock`` on ``claims/<key>.lock``).

        Writers of one cell take turns, so a cell is computed once even when sweeps overlap: whoever comes
        second finds the cell finished. The holder removes the lock file when it is done (also on Ctrl-C);
        the kernel drops the lock when its holder exits for any reason
        (``kill -9``, the OOM killer, a Slurm time-out), so no claim outlives its process. NOTE: ``flock``
        works across hosts on NFS (Linux maps it to NFS byte-range locks) and on Lustre/GPFS mounted with
        locking; a file system without locks makes this a no-op, and then the last rename wins as before.
        """
        path = self.root / "claims" / f"{key}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = None
        try:
            while True:
                handle = open(path, "a")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX)
                except OSError as err:  # a file system without locks
                    what = (
                        "grid.json may lose a concurrent run's keys"
                        if key == _GRID_CLAIM
                        else f"cell {key} may be computed twice"
                    )
                    log.warning("cannot lock %s (%s): %s", path, err, what)
                    break
                # NOTE: the holder before this one removed the file it locked (below); a waiter that locked
                # that removed file holds nothing, so it locks the file now at the path instead.
                try:
                    if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                        break
                except FileNotFoundError:
                    pass
                handle.close()
        except BaseException:  # Ctrl-C while taking the claim: leave no lock file that nobody holds
            if handle is not None and not handle.closed:
                _drop_unheld(path, handle)
            raise
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # NOTE: while still locked, so no waiter takes the stale file
            handle.close()

    def check_writable(self) -> None:
        """Raise :class:`PermissionError` naming the folder unless a cell could be stored here now.

        Creates the store's folders and a temporary file in each (then removes it), so a read-only or
        full results directory is found before any cell is computed.
        """
        for directory in (self.cells_dir, self.per_layer_dir, self.root / "claims"):
            try:
                directory.mkdir(parents=True, exist_ok=True)
                probe = directory / f"{_TMP_PREFIX}probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as err:
                raise PermissionError(
                    f"results_dir={self.root}: cannot write into {directory} ({err.strerror or err})"
                ) from err

    def config(self, key: str) -> dict[str, Any]:
        """The resolved config cell ``key`` was run with (read once its file passed :meth:`read`'s checks)."""
        return self.read_with_config(key)[1]

    @property
    def grid_path(self) -> Path:
        return self.root / "grid.json"

    def grid_keys(self) -> set[str] | None:
        """The keys ``grid.json`` records, or None without one. Raises :class:`GridFileError` naming the
        file when it is there but is no JSON list of cell keys (truncated, edited, a directory)."""
        path = self.grid_path
        if not path.exists() and not path.is_symlink():
            return None
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError) as err:  # NOTE: UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise GridFileError(path, f"cannot be read as JSON ({err})") from err
        if not isinstance(data, list) or not all(isinstance(k, str) for k in data):
            raise GridFileError(path, f"holds {type(data).__name__}, not a list of cell keys")
        return set(data)

    def write_grid(self, keys: Iterable[str], extend: bool = False) -> set[str]:
        """Record the keys of the experiment's current grid (atomically), so loads skip stale cells.

        ``extend``: the grid becomes the union of ``keys`` and the grid recorded before (a sweep that adds
        trace seeds to a finished grid keeps the finished ones in it); the read and the write happen under
        one claim, so two extending runs do not lose each other's keys. Returns the keys recorded before
        (empty without a ``grid.json``). A damaged ``grid.json`` is replaced (its keys cannot be read, and
        the grid written now is the grid), except with ``extend``, which raises :class:`GridFileError`
        before writing anything: the union would lose the keys it held.
        """
        wanted = set(keys)
        with self.claim(_GRID_CLAIM):
            try:
                before = self.grid_keys() or set()
            except GridFileError:
                if extend:
                    raise
                before = set()
                _remove_non_file(self.grid_path)
            text = json.dumps(sorted(wanted | before if extend else wanted)).encode()
            atomic_write(self.grid_path, lambda fh: fh.write(text), ".json")
        return before

    def current_keys(self, all_cells: bool = False) -> list[str]:
        """Finished cells of the current grid (``grid.json``), or every finished cell without one."""
        done = self.keys()
        grid = None if all_cells else self.grid_keys()
        return done if grid is None else [k for k in done if k in grid]

    def load(self, all_cells: bool = False) -> pd.DataFrame:
        """Finished cells' rows in one frame, with a ``cell`` column holding each row's key.

        Only the current grid's cells when ``grid.json`` exists, unless ``all_cells``.
        Unreadable cells are left out (each logged, naming its file; :meth:`corrupt_keys` lists them).
        """
        return self.contents(all_cells).rows

    def contents(self, all_cells: bool = False) -> StoreContents:
        """:meth:`load`'s rows, each cell's config, the unreadable cells and the grid's unfinished ones,
        from one read of each cell file."""
        frames, configs, corrupt, lost = [], {}, [], []
        done = self.current_keys(all_cells)
        for k in done:
            try:
                rows, configs[k], why = self._read_cell(k)
            except FileNotFoundError:  # NOTE: removed since it was listed
                continue
            except CorruptCellError as err:
                log.warning("%s", err)
                corrupt.append(k)
                continue
            if why:
                lost.append(k)
            frames.append(rows.assign(cell=k))
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"cell": []})
        grid = None if all_cells else self.grid_keys()
        unfinished = sorted(grid - set(done)) if grid is not None else []
        return StoreContents(frame, configs, corrupt, unfinished, lost)

    def load_per_layer(self, all_cells: bool = False) -> pd.DataFrame:
        """Finished cells' per-layer tables in one frame, with a ``cell`` column (grid rule as ``load``)."""
        return self.per_layer_contents(all_cells)[0]

    def per_layer_contents(self, all_cells: bool = False) -> tuple[pd.DataFrame, list[str]]:
        """:meth:`load_per_layer`'s frame and the keys whose per-layer file exists but cannot be read or
        trusted (left out of the frame, each logged)."""
        frames, corrupt = [], []
        for k in self.current_keys(all_cells):
            try:
                table = self.read_per_layer(k)
            except CorruptCellError as err:
                log.warning("%s", err)
                corrupt.append(k)
                continue
            if table is not None:
                frames.append(table.assign(cell=k))
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame({"cell": []})
        return frame, corrupt

    def clean_stale(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files left by crashed writers older than ``older_than_s``; returns how many."""
        now = time.time()
        removed = 0
        for directory in (self.cells_dir, self.per_layer_dir, self.root):
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
    rows are replaced only once the new ones are written (atomically). A cell whose file is unreadable
    counts as missing. The cell is computed under :meth:`ResultsStore.claim`, and looked up again once
    the claim is held, so two sweeps of one grid compute each cell once.
    """
    key = cell_key(config)
    store.clean_stale()
    if not recompute and (rows := store.finished(key)) is not None:
        return rows, True
    with store.claim(key):
        if not recompute and (rows := store.finished(key)) is not None:
            return rows, True  # another writer finished it while this one waited for the claim
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
