"""One provenance per table: which code computed its cells, and refusing tables that mix code versions.

Every result row carries ``code_version`` (:func:`relibra.provenance.code_version`). A table built from
cells of several code versions compares numbers that different code produced, so the analysis refuses it
(and so it does a table of cells whose version names no code, :func:`relibra.provenance.identifies_code`),
unless the versions are shown to give identical cells: a file ``identical_versions.json`` at the results
root lists groups of versions, each with the evidence that they compute the same numbers (e.g. the pinned
cells, ``tests/test_pinned_cells.py``, re-recorded identically between them)::

    {"groups": [{"versions": ["0.1.0+g1a2b3c4d5e6f", "0.1.0+g9f86d0818840"],
                 "evidence": "scripts/pin_cells.py re-records identically at both commits"}]}
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.load import code_versions
from relibra.provenance import identifies_code

__all__ = [
    "IDENTICAL_FILE",
    "IdenticalVersionsError",
    "load_identical_groups",
    "mixed_versions_refusal",
    "provenance_line",
]

IDENTICAL_FILE = "identical_versions.json"
"""File at the results root that lists code versions shown to compute identical cells."""


class IdenticalVersionsError(ValueError):
    """``identical_versions.json`` is malformed; the message names the file, the key and the problem."""


def load_identical_groups(root: Path) -> list[frozenset[str]]:
    """The groups of code versions of ``root/identical_versions.json`` (none when the file is absent).

    Raises :class:`IdenticalVersionsError` for bad JSON, a missing ``groups`` list, a group without at least
    two versions (strings) or without a non-empty ``evidence`` string.
    """
    path = root / IDENTICAL_FILE
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise IdenticalVersionsError(f"{path}: not JSON ({exc})") from exc
    groups = data.get("groups") if isinstance(data, dict) else None
    if not isinstance(groups, list):
        raise IdenticalVersionsError(f"{path}: expected an object with a list 'groups'")
    out = []
    for i, group in enumerate(groups):
        versions = group.get("versions") if isinstance(group, dict) else None
        if (
            not isinstance(versions, list)
            or len(versions) < 2
            or any(not isinstance(v, str) for v in versions)
        ):
            raise IdenticalVersionsError(
                f"{path}: groups[{i}].versions: expected a list of >= 2 version strings"
            )
        evidence = group.get("evidence")
        if not isinstance(evidence, str) or not evidence.strip():
            raise IdenticalVersionsError(
                f"{path}: groups[{i}].evidence: expected a non-empty string saying how the versions were "
                "shown to compute identical cells"
            )
        out.append(frozenset(versions))
    return out


def mixed_versions_refusal(name: str, frame: pd.DataFrame, groups: list[frozenset[str]]) -> str | None:
    """Why the tables of experiment ``name`` are refused, or None when its cells are of one code version
    (or of versions that one of ``groups`` shows identical)."""
    versions = code_versions(frame)
    unnamed = {v: n for v, n in versions.items() if not identifies_code(v)}
    if unnamed:  # NOTE: two cells of such a version may come from different code: never taken as equal
        listed = ", ".join(f"{n} rows by {v}" for v, n in sorted(unnamed.items()))
        return (
            f"{name}: tables refused: {listed}: a code version without a commit or a source hash names no "
            "code, so its cells cannot be shown to come from one code version; recompute them "
            "(`python -m experiments.reproduce --recompute-stale`)"
        )
    if len(versions) <= 1 or any(set(versions) <= group for group in groups):
        return None
    listed = ", ".join(f"{n} rows by {v}" for v, n in sorted(versions.items()))
    return (
        f"{name}: tables refused: its cells were computed by {len(versions)} code versions ({listed}); "
        "recompute the older ones (`python -m experiments.reproduce --recompute-stale`) or show the "
        f"versions identical in {IDENTICAL_FILE} at the results root (analysis/provenance.py)"
    )


def provenance_line(frame: pd.DataFrame, command: str, table_version: str) -> str:
    """One line for a table's foot: the code version(s) of its cells and the command that wrote it."""
    versions = code_versions(frame)
    cells = "; ".join(f"`{_code(v)}` ({n} rows)" for v, n in sorted(versions.items()))
    return f"Provenance: cells computed by {cells}; table written by `{_code(command)}` at `{table_version}`."


def _code(text: str) -> str:
    """``text`` inside a Markdown code span: one line, no backtick (which would end the span early)."""
    return " ".join(str(text).replace("`", "'").split())
