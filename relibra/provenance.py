"""Which code produced a result: the package version and, in a git checkout, the commit it ran from.

The results store keys a cell by its resolved config alone (:func:`experiments.store.keys.cell_key`), so a
cell finished by older code is read back after the code changes. Every result row carries ``code_version`` so
that such cells can be found (``python -m experiments.reproduce`` reports them and ``--recompute-stale``
runs them again).

When git cannot say (it refuses a checkout owned by another user, "dubious ownership"; it is not
installed; the code is no checkout at all) the version records what is known without it: the commit that
``.git/HEAD`` names, if any, and a hash of the package's source files as they are, ``<version>+g<commit>
.src.<hash>`` or ``<version>+src.<hash>``. Two different edits then still get two versions. Whether the
files differ from the commit is unknown, and :func:`code_version_note` says so in the run's output. A
version without such a local part (``0.1.0``, as recorded before, or ``unknown``) identifies no code
(:func:`identifies_code`): it is never taken as equal to another.
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
from functools import lru_cache
from pathlib import Path

from relibra import __version__

__all__ = ["code_version", "code_version_note", "identifies_code"]

log = logging.getLogger(__name__)

_ROOT = Path(__file__).resolve().parents[1]


def _run_git(*args: str) -> tuple[str | None, str]:
    """``(stdout, "")`` of ``git args`` in the checkout, or ``(None, why)`` when git fails or is absent."""
    # NOTE: --no-optional-locks: `git status` would otherwise refresh and rewrite the index under
    # .git/index.lock; a run killed meanwhile (a full disk: SIGXFSZ) left that lock in the user's checkout,
    # and every later git command of theirs failed on it.
    try:
        out = subprocess.run(
            ["git", "-C", str(_ROOT), "--no-optional-locks", *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"git could not run ({err})"
    if out.returncode != 0:
        said = " ".join(out.stderr.split()) or f"exit status {out.returncode}"
        return None, said
    return out.stdout.strip(), ""


def _git(*args: str) -> str | None:
    return _run_git(*args)[0]


def _diff_hash() -> str:
    """12 hex digits of the SHA-256 of the uncommitted edits to tracked files (``git diff HEAD``)."""
    diff = _git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff") or ""
    return hashlib.sha256(diff.encode()).hexdigest()[:12]


SOURCE_DIRS = ("relibra", "baselines", "experiments", "analysis")
"""The packages whose files :func:`_source_hash` covers (pyproject.toml's packages)."""
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".json", ".csv", ".toml")
"""The files of those packages that make up the code: sources, configs, committed data."""


def _source_hash() -> str:
    """12 hex digits of the SHA-256 of every source file of :data:`SOURCE_DIRS` (path and bytes, in path
    order) and ``pyproject.toml``: what identifies the code when git cannot say."""
    files = [_ROOT / "pyproject.toml"]
    for package in SOURCE_DIRS:
        files += [
            p
            for p in (_ROOT / package).rglob("*")
            if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.is_file()
        ]
    digest = hashlib.sha256()
    for path in sorted(set(files)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        name = path.relative_to(_ROOT).as_posix().encode()
        digest.update(hashlib.sha256(name).digest() + hashlib.sha256(data).digest())
    return digest.hexdigest()[:12]


def _head_commit() -> str | None:
    """The commit ``.git/HEAD`` names (12 hex digits), read from the files without running git; None
    when there is no ``.git`` folder or it cannot be read."""
    git_dir = _ROOT / ".git"
    try:
        head = (git_dir / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            commit = head
        else:
            ref = head.removeprefix("ref: ")
            loose = git_dir / ref
            if loose.is_file():
                commit = loose.read_text().strip()
            else:
                packed = (git_dir / "packed-refs").read_text().splitlines()
                commit = next(line.split()[0] for line in packed if line.endswith(" " + ref))
    except (OSError, StopIteration, IndexError):
        return None
    ok = len(commit) >= 12 and all(c in "0123456789abcdef" for c in commit)
    return commit[:12] if ok else None


def _version_and_note() -> tuple[str, str | None]:
    commit, why = _run_git("rev-parse", "--short=12", "HEAD")
    if commit:
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return f"{__version__}+g{commit}" + (f".dirty.{_diff_hash()}" if dirty else ""), None
    head = _head_commit()
    local = (f"g{head}." if head else "") + f"src.{_source_hash()}"
    version = f"{__version__}+{local}"
    if (_ROOT / ".git").exists():
        note = (
            f"git cannot read the checkout {_ROOT} ({why}): the code version is unknown to git; recorded as "
            f"{version}: "
            + (f"the commit .git/HEAD names ({head}) and " if head else "")
            + "a hash of the source files (whether they differ from that commit is unknown)"
        )
    else:
        note = (
            f"{_ROOT} is no git checkout: the code version is unknown to git; recorded as {version} "
            "(a hash of the source files)"
        )
    return version, note


@lru_cache(maxsize=1)
def code_version() -> str:
    """``<version>+g<commit>``, with ``.dirty.<hash of the diff>`` when tracked files differ from the
    commit; where git cannot say, ``<version>+g<commit>.src.<hash>`` or ``<version>+src.<hash>`` (module
    docstring).

    The diff's hash tells two different uncommitted edits of one commit apart (the same edit gives the
    same version). Untracked files are not part of it. Examples: ``0.1.0+g1a2b3c4d5e6f``,
    ``0.1.0+g1a2b3c4d5e6f.dirty.9f86d081884c``, ``0.1.0+g1a2b3c4d5e6f.src.0c1d2e3f4a5b``.
    """
    version, note = _version_and_note()
    if note:
        log.warning("%s", note)  # NOTE: once per process (cached), in the run's output
    return version


@lru_cache(maxsize=1)
def code_version_note() -> str | None:
    """Why :func:`code_version` is not git's (git refused the checkout, or there is none), or None."""
    return _version_and_note()[1]


def identifies_code(version: str) -> bool:
    """Whether a recorded ``code_version`` names the code that computed a cell: a commit (``+g...``) or a
    hash of the source files (``+...src...``). ``0.1.0`` (recorded without either, e.g. by a checkout git
    refused before the source hash existed) and ``unknown`` (no column) do not: two such cells are never
    taken as computed by the same code."""
    _, plus, local = version.partition("+")
    return bool(plus and local)
