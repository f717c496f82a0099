"""Two results stores side by side, for the scripts that compare them (``scripts/compare_generations.py``,
``scripts/identical_stores.py``): their command line (``OLD_ROOT NEW_ROOT [--presets ...]``) and the presets
both roots hold."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["parse_store_pair", "presets_of", "shared_presets"]


def presets_of(root: Path) -> set[str]:
    """Presets of a results root: its folders holding a ``cells`` folder (none when it is no folder)."""
    return {p.name for p in root.iterdir() if (p / "cells").is_dir()} if root.is_dir() else set()


def shared_presets(old: Path, new: Path, presets: str | None) -> list[str]:
    """The comma-separated ``presets`` (default: every preset both roots hold, sorted). Raises ValueError
    naming the root that is not a results store, or the presets that are not in both roots."""
    for root in (old, new):
        if not presets_of(root):
            raise ValueError(f"{root}: not a results store (no <preset>/cells folder)")
    shared = presets_of(old) & presets_of(new)
    chosen = [p for p in presets.split(",") if p] if presets else sorted(shared)
    missing = [p for p in chosen if p not in shared]
    if missing:
        raise ValueError(f"--presets {','.join(missing)}: not in both roots")
    return chosen


def parse_store_pair(description: str, argv: list[str] | None) -> tuple[Path, Path, list[str]]:
    """``(old root, new root, the presets to compare)`` from the command line (:func:`shared_presets`); a
    root that is no results store, or a preset not in both, exits with status 2 and one message."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--presets", default=None, help="comma-separated (default: every preset both roots hold)")
    args = ap.parse_args(argv)
    try:
        return args.old, args.new, shared_presets(args.old, args.new, args.presets)
    except ValueError as err:
        ap.exit(2, f"{ap.prog}: {err}\n")
