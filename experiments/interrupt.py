"""Ctrl-C while ``python -m experiments.<module>`` is still importing: one line and exit status 130.

The entry points (:func:`experiments.run.cli`, :func:`experiments.grid.cli.main`) catch
``KeyboardInterrupt`` themselves once they run; before that, importing the suite (numpy, numba, Hydra, the
planners) takes seconds, and a Ctrl-C there would end in Python's traceback. :func:`quiet_interrupt`
installs a ``sys.excepthook`` that prints one line for an uncaught ``KeyboardInterrupt`` and exits with
130 (128 + SIGINT, the shell's convention); any other exception goes to Python's own hook.
:mod:`experiments` installs it only when it is imported to run one of its modules (``sys.argv[0]`` is
``-m`` while Python locates the module, per the ``-m`` documentation), never for a library user.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

__all__ = ["EXIT_INTERRUPTED", "quiet_interrupt"]

EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, the shell's convention)."""


def _hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    print("python -m experiments: interrupted", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)  # NOTE: raising SystemExit inside an excepthook prints another traceback


def quiet_interrupt() -> None:
    """Install the hook (module doc) when this process runs a module with ``python -m``."""
    if sys.argv[:1] == ["-m"]:
        sys.excepthook = _hook
