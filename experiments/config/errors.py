"""How the entry points refuse a configuration: :class:`ConfigError`, one line on stderr, exit status 2
(docs/architecture.md, "Where the code lives"; every module of :mod:`experiments.config` raises it)."""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["EXIT_BAD_CONFIG", "ConfigError", "refuse"]


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the keys and what would be right."""


EXIT_BAD_CONFIG = 2
"""Exit status of every entry point for a configuration it refuses."""


def refuse(exc: ConfigError, where: str = "") -> NoReturn:
    """Print ``exc`` as one line on stderr (prefixed by the program and ``where``) and exit with status 2."""
    text = " ".join(str(exc).split())
    print(f"relibra-run: {where}{text}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)
