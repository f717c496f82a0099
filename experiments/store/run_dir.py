"""A run directory replaced as a whole or not at all: the new run's files are written beside the old ones,
then swapped in.

:func:`commit_run` writes every file of a run (results, summary, per-layer table, plans, Hydra's
``.hydra/*.yaml``) into a private staging folder inside the run directory (``.tmp-run-*``, a name readers
skip), each flushed and fsynced. Only once all of them are written does it move them into place
(``os.replace``, atomic per file on one file system), ``results.parquet`` last, and remove the earlier
run's run files that this run does not have. A failure while writing (a full disk, a value parquet cannot
hold, Ctrl-C) removes the staging folder and leaves the directory exactly as it was. NOTE: POSIX has no
atomic exchange of several files, so a process killed during the moves themselves (a few renames, no
writing) can leave a mix; the summary is moved before the results, so ``results.parquet`` never belongs to
an older run than ``summary.json``.

Files that are not run files (Hydra's job log, a W&B folder) are left alone.

A refused run leaves no new directory: :class:`experiments.sweep_check.CheckCells` refuses a bad config
before Hydra makes the run directory, and notes (:func:`note_new_dirs`) which folders of its path do not
exist yet; a refusal that needs the built inputs (a workload over memory) comes once Hydra has made them,
and :func:`remove_new_dirs` removes those of them that hold nothing but Hydra's job log.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import BinaryIO

from relibra.atomic import TMP_PREFIX, file_mode

__all__ = ["HYDRA_FILES", "RUN_FILES", "commit_run", "note_new_dirs", "remove_new_dirs"]

RUN_FILES = ("results.parquet", "summary.json", "per_layer.parquet", "plans.npz")
"""The files a run may write into its run directory (any other file there is left alone)."""

HYDRA_FILES = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")
"""Hydra's record of the run, replaced with the run files (:func:`experiments.run.run` writes them)."""

_LAST = "results.parquet"


def _write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
        os.fchmod(handle.fileno(), file_mode())


def commit_run(run_dir: Path, files: Mapping[str, Callable[[BinaryIO], object]]) -> None:
    """Make ``run_dir`` hold exactly ``files`` (relative name -> writer) of :data:`RUN_FILES` and
    :data:`HYDRA_FILES` (module docstring). Raises OSError naming the file a write failed on."""
    run_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}run-", dir=run_dir))
    try:
        for name, write in files.items():
            try:
                _write(staging / name, write)
            except OSError as err:
                raise OSError(
                    err.errno, f"cannot write the run file {run_dir / name} ({err.strerror or err})"
                ) from err
        for name in sorted(files, key=lambda n: (n == _LAST, n == "summary.json", n)):
            (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, run_dir / name)
        for name in (*RUN_FILES, *HYDRA_FILES):
            if name not in files:
                (run_dir / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


_NEW_DIRS: list[Path] = []
"""The folders of this process's run directory that did not exist before Hydra made them, deepest first."""


def note_new_dirs(run_dir: Path) -> None:
    """Remember which of ``run_dir`` and its parents do not exist yet (called before Hydra makes them)."""
    path = run_dir.absolute()
    _NEW_DIRS[:] = [p for p in (path, *path.parents) if not p.exists()]


def remove_new_dirs(leftovers: Collection[str] = ()) -> list[Path]:
    """Remove the folders :func:`note_new_dirs` noted, deepest first, each only while it holds nothing but
    files named in ``leftovers`` (Hydra's job log); stop at the first that holds anything else. Returns the
    folders removed."""
    removed: list[Path] = []
    for folder in _NEW_DIRS:
        try:
            entries = list(folder.iterdir())
        except OSError:
            break
        if any(e.name not in leftovers or not e.is_file() for e in entries):
            break
        try:
            for entry in entries:
                entry.unlink()
            folder.rmdir()
        except OSError:
            break
        removed.append(folder)
    _NEW_DIRS.clear()
    return removed
