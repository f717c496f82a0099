"""Atomic file writes: a reader sees either the old file or the whole new one, never a part.

Every result, plan, trace and store file of the suite is written through :func:`atomic_write`: a unique
temporary name (``TMP_PREFIX`` + random) in the target's own directory, flushed and fsynced, given the
mode a plain ``open()`` would give it (``0o666`` less the process umask, so a group can read shared
results when the umask allows), then moved into place with ``os.replace`` (atomic on POSIX within one
file system), and the directory fsynced so the rename survives a power loss.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import BinaryIO

__all__ = ["TMP_PREFIX", "atomic_write", "file_mode"]

TMP_PREFIX = ".tmp-"
"""Prefix of every temporary file :func:`atomic_write` creates (readers of a folder skip these names)."""


@lru_cache(maxsize=1)
def _umask() -> int:
    # NOTE: os.umask can only be read by setting it; /proc gives it without that (brief, process-wide)
    # change where it exists. The umask is fixed for the life of a run, hence the cache.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The permission bits a new file gets from ``open()``: ``0o666`` less the umask."""
    return 0o666 & ~_umask()


def _fsync_dir(directory: Path) -> None:
    # NOTE: makes the rename itself durable across a power loss; not all file systems allow opening a
    # directory, so a failure here is not an error (the rename is still atomic for other processes).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _naming(err: OSError, path: Path) -> OSError:
    """``err`` again (same errno, hence the same OSError subclass) with the file being written named."""
    if err.errno is None:
        return OSError(f"cannot write {path}: {err}")
    return OSError(err.errno, f"cannot write {path}: {err.strerror or err}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], suffix: str = "") -> Path:
    """Write ``path`` through ``write(binary file)`` atomically (module docstring); returns the path.

    On any failure (including KeyboardInterrupt) the temporary file is removed and ``path`` is untouched.
    An OSError (a full disk, a read-only folder) is raised again with ``path`` in its message, as the same
    OSError subclass.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=suffix, dir=path.parent)
    except OSError as err:
        raise _naming(err, path) from err
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), file_mode())  # NOTE: mkstemp creates 0600 whatever the umask
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _naming(err, path) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path
