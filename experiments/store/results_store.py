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

Cell keys (16 hex digits of a hash of the resolved config, a trace file keyed by its content):
:mod:`experiments.store.keys`; cells stored before content keys are computed once more under content keys
(``reproduce`` says so).

Atomicity: every file is written by :func:`relibra.atomic.atomic_write` (a unique ``.tmp-*`` name in its
final directory, fsync, ``os.replace``). The per-layer file is written before the cell file, so a cell is
finished exactly when ``cells/<key>.parquet`` exists, and a finished cell always has its per-layer table
if it has one. A crashed writer leaves only a ``.tmp-*`` file, which readers ignore, a rerun redoes and
:meth:`ResultsStore.clean_stale` (run by every :func:`~experiments.store.access.run_cell`) removes once it
is an hour old.

Concurrent writers: :func:`~experiments.store.access.run_cell` computes a cell only under
:meth:`ResultsStore.claim` and looks it up again once the claim is held, so a cell is computed once however
many sweeps reach it.

Verified reads: :mod:`experiments.store.cell_files` (each read checks the file's key, config and content
checksum; a file that fails counts as missing and is recomputed).

When a preset or a planner's config changes, its cells get new keys and the old cells stay on disk. A
driver that knows the grid (``experiments.reproduce``) writes ``grid.json``; loading then returns only
the grid's finished cells (``all_cells=True`` returns every cell on disk). A run whose overrides narrow
the preset's sweep (``seed=1,2``) records only its own cells unless asked to extend the grid
(``experiments.reproduce --extend-grid``); the runner says how many finished cells the new grid leaves out.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.store.cell_files import (
    _CHECKSUM_META,
    _CONFIG_META,
    _KEY_META,
    _PER_LAYER_META,
    CorruptCellError,
    GridFileError,
    _drop_unheld,
    _read_table,
    _remove_non_file,
    _verified,
    _verified_with_config,
    atomic_write_parquet,
    content_checksum,
)
from experiments.store.keys import cell_key, keyed_config
from relibra.atomic import TMP_PREFIX, atomic_write

__all__ = ["ResultsStore", "StoreContents"]

_TMP_PREFIX = TMP_PREFIX
_GRID_CLAIM = "grid.json"
"""The claim (``claims/grid.json.lock``) under which ``grid.json`` is read and rewritten; no cell key
(16 hex digits) takes this name."""

log = logging.getLogger(__name__)


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
