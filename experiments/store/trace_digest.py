"""What a trace file holds, as one digest: the part of a cell's key that says which routing it ran on.

A cell that reads a routing trace (``trace.path``) is keyed by the trace's content, never by its path
(:func:`experiments.store.keys.cell_key`): a trace replaced at the same path gets new cells, and a store moved
or copied with its trace reuses its cells. The digest covers every array of the ``.npz`` file (docs/traces.md,
"Routing trace file"): SHA-256 over, in name order, the SHA-256 of each member's name and of its
uncompressed ``.npy`` bytes.
A ``.npy`` member's bytes are its header (dtype, shape, memory order) and its data, so two files with the
same arrays give one digest whether or not they are compressed or when they were zipped, and any changed
value, dtype or shape gives another. The file is streamed, never loaded whole.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
import zlib
from functools import lru_cache
from pathlib import Path
from stat import S_ISREG

__all__ = ["TraceDigestError", "trace_digest"]

_CHUNK = 1 << 20
"""Bytes hashed per read (1 MiB)."""


class TraceDigestError(ValueError):
    """The trace file cannot be read as an ``.npz`` archive; the message names the file."""


def trace_digest(path: str | Path) -> str:
    """``sha256:<64 hex digits>`` of the arrays of the trace file at ``path`` (module docstring).

    Computed once per process while the file is unchanged (same device, inode, size, mtime and ctime).
    Raises :class:`TraceDigestError` naming the file when it is missing or not an ``.npz`` archive.
    """
    try:
        stat = os.stat(path)
    except OSError as err:
        raise TraceDigestError(f"trace.path={path}: cannot read it ({err.strerror or err})") from err
    if not S_ISREG(stat.st_mode):  # NOTE: /dev/zero or a FIFO would be read without end
        raise TraceDigestError(f"trace.path={path}: not a regular file")
    return _digest(str(path), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@lru_cache(maxsize=8)
def _digest(path: str, dev: int, ino: int, size: int, mtime_ns: int, ctime_ns: int) -> str:
    # NOTE: ctime cannot be set by a user (unlike mtime, which `cp -p` and `touch` copy), so a file
    # replaced by another of the same size and mtime is still hashed again.
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(path) as archive:
            for name in sorted(archive.namelist()):
                member_digest = hashlib.sha256()
                with archive.open(name) as member:
                    while chunk := member.read(_CHUNK):
                        member_digest.update(chunk)
                digest.update(hashlib.sha256(name.encode()).digest() + member_digest.digest())
    except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as err:
        raise TraceDigestError(f"trace.path={path}: not a readable .npz archive ({err})") from err
    return f"sha256:{digest.hexdigest()}"
