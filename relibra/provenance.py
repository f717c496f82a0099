"""Which code produced a result: the package version and, in a git checkout, the commit it ran from.

The results store keys a cell by its resolved config alone (:func:`experiments.store.cell_key`), so a cell
finished by older code is read back after the code changes. Every result row carries ``code_version`` so
that such cells can be found (``python -m experiments.reproduce`` reports them and ``--recompute-stale``
runs them again).
"""

from __future__ import annotations

import hashlib
import subprocess
from functools import lru_cache
from pathlib import Path

from relibra import __version__

__all__ = ["code_version"]

_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    # NOTE: --no-optional-locks: `git status` would otherwise refresh and rewrite the index under
    # .git/index.lock; a run killed meanwhile (a full disk: SIGXFSZ) left that lock in the user's checkout,
    # and every later git command of theirs failed on it.
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), "--no-optional-locks", *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _diff_hash() -> str:
    """12 hex digits of the SHA-256 of the uncommitted edits to tracked files (``git diff HEAD``)."""
    diff = _git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff") or ""
    return hashlib.sha256(diff.encode()).hexdigest()[:12]


@lru_cache(maxsize=1)
def code_version() -> str:
    """``<version>+g<commit>``, with ``.dirty.<hash of the diff>`` when tracked files differ from the
    commit, or ``<version>`` outside git.

    The diff's hash tells two different uncommitted edits of one commit apart (the same edit gives the
    same version). Untracked files are not part of it. Examples: ``0.1.0+g1a2b3c4d5e6f``,
    ``0.1.0+g1a2b3c4d5e6f.dirty.9f86d081884c``, ``0.1.0``.
    """
    commit = _git("rev-parse", "--short=12", "HEAD")
    if not commit:
        return __version__
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return f"{__version__}+g{commit}" + (f".dirty.{_diff_hash()}" if dirty else "")
