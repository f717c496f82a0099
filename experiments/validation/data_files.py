"""Reading the measurement files of ``experiments/data`` (end-to-end runs, per-layer rows, penalty pairs):
one JSON object with a ``rows`` list, refused with one :class:`~experiments.config.errors.ConfigError` naming
the file otherwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.config.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
"""``experiments/data``: the committed measurement files, each naming its source."""

__all__ = ["read_rows_file"]


def read_rows_file(path: str | Path, what: str) -> dict[str, Any]:
    """The object in ``path`` (``what``: how messages name the file, e.g. ``end-to-end data``); refuses a
    missing or unreadable file, and one without a ``rows`` list."""
    try:
        doc: Any = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{what} {path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ConfigError(f"{what} {path}: expected an object with a 'rows' list")
    return doc
