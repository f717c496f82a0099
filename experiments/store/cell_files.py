"""One file of the results store: written atomically with its key, config and content checksum in the
parquet schema metadata, and read back only once that metadata proves it is the cell asked for
(:func:`_verified_with_config`); the errors that name a file which cannot be trusted. The store's layout
and its guarantees: :mod:`experiments.store.results_store`.

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
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from experiments.store.keys import stored_under
from relibra.atomic import atomic_write

__all__ = ["CorruptCellError", "GridFileError", "atomic_write_parquet", "content_checksum"]

_CONFIG_META = b"relibra.config"
_KEY_META = b"relibra.cell"
_CHECKSUM_META = b"relibra.checksum"
_PER_LAYER_META = b"relibra.per_layer"
"""In a cell file: the content checksum of the per-layer table written with it (empty: it has none).
Cells written before this key existed say nothing about theirs."""

log = logging.getLogger(__name__)


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
        if not isinstance(config, dict) or not stored_under(config, key):
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
