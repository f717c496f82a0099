"""Read an offline W&B run directory back (config, history, summary, logged tables) without a server.

An offline run (``WANDB_MODE=offline``) keeps everything it logged in ``run-<id>.wandb``: a 7-byte header
(``:W&B``, magic ``0xBEE1``, version) then protobuf ``wandb_internal_pb2.Record`` messages framed in the
LevelDB log format (32 KiB blocks; each chunk is a 4-byte checksum, 2-byte little-endian length, 1-byte
type FULL/FIRST/MIDDLE/LAST; a block tail shorter than a chunk header is zero padding). The framing follows
LevelDB's ``doc/log_format.md``; the record messages are wandb's own protobuf classes. Logged tables are
JSON files under ``files/`` whose path the summary holds. Checksums are not verified (a torn tail raises).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["OfflineRun", "find_offline_runs", "read_offline_run"]

_HEADER = b":W&B\xe1\xbe"
_HEADER_LEN = 7
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass(frozen=True)
class OfflineRun:
    """What one offline run logged."""

    run_dir: Path
    run_id: str
    project: str
    group: str
    name: str
    config: dict[str, Any]
    history: list[dict[str, Any]]
    """One dict per ``run.log`` step (nested keys as nested dicts)."""
    summary: dict[str, Any]
    """The final summary (every update applied in order)."""

    def table(self, key: str) -> pd.DataFrame:
        """A ``wandb.Table`` logged under ``key``, read from its JSON file."""
        ref = self.summary.get(key)
        if not isinstance(ref, dict) or "path" not in ref:
            raise KeyError(
                f"run {self.run_id}: summary has no table under {key!r} (keys: {sorted(self.summary)})"
            )
        doc = json.loads((self.run_dir / "files" / ref["path"]).read_text())
        return pd.DataFrame(doc["data"], columns=doc["columns"])


def _records(data: bytes) -> list[bytes]:
    """Payloads of the LevelDB-log-framed records after the W&B header."""
    if not data.startswith(_HEADER):
        raise ValueError(f"not a W&B run file: header {data[:_HEADER_LEN]!r}, expected {_HEADER!r} + version")
    out: list[bytes] = []
    pos, pending = _HEADER_LEN, b""
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:
            pos += left
            continue
        _, length, kind = _CHUNK.unpack_from(data, pos)
        pos += _CHUNK.size
        if kind == 0 and length == 0:  # zero padding at a block tail or a preallocated end
            pos += left - _CHUNK.size
            continue
        if pos + length > len(data) or kind not in (_FULL, _FIRST, _MIDDLE, _LAST):
            raise ValueError(
                f"corrupt W&B run file at byte {pos - _CHUNK.size}: chunk type {kind}, length {length}"
            )
        chunk = data[pos : pos + length]
        pos += length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            out.append(pending)
            pending = b""
    return out


def _set(tree: dict[str, Any], path: list[str], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def _items(items: Any) -> list[tuple[list[str], Any]]:
    return [(list(it.nested_key) or [it.key], json.loads(it.value_json)) for it in items]


def read_offline_run(run_dir: str | Path) -> OfflineRun:
    """Parse the ``run-*.wandb`` file of ``run_dir`` (e.g. ``wandb/offline-run-<time>-<id>``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir = Path(run_dir)
    files = sorted(run_dir.glob("run-*.wandb"))
    if len(files) != 1:
        raise FileNotFoundError(f"{run_dir} must hold exactly one run-*.wandb file, found {len(files)}")
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    ident = {"run_id": "", "project": "", "group": "", "name": ""}
    for payload in _records(files[0].read_bytes()):
        record = pb.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            ident = {
                "run_id": run.run_id,
                "project": run.project,
                "group": run.run_group,
                "name": run.display_name,
            }
            for path, value in _items(run.config.update):
                _set(config, path, value)
        elif kind == "config":
            for path, value in _items(record.config.update):
                _set(config, path, value)
        elif kind == "summary":
            for path, value in _items(record.summary.update):
                _set(summary, path, value)
        elif kind == "history":
            row: dict[str, Any] = {}
            for path, value in _items(record.history.item):
                _set(row, path, value)
            history.append(row)
    config.pop("_wandb", None)
    return OfflineRun(run_dir=run_dir, config=config, history=history, summary=summary, **ident)


def find_offline_runs(root: str | Path) -> list[Path]:
    """Every offline run directory under ``root`` (``**/offline-run-*``), sorted."""
    return sorted(p.parent for p in Path(root).rglob("offline-run-*/run-*.wandb"))
