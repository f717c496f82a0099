"""Readers of one config key each, collecting a problem naming the key instead of raising (the checks of
:func:`experiments.config.checks.check_config` gather every problem of a configuration before refusing it
once)."""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["_int_key", "_number_key", "_yaml"]


def _int_key(
    cfg: DictConfig,
    key: str,
    problems: list[str],
    least: int | None = 1,
    required: bool = False,
    most: int | None = None,
) -> int | None:
    """``cfg.<key>`` when it is an integer in [``least``, ``most``] (None when unset; a problem when unset
    and ``required``); else a problem naming the key."""
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        if required:
            problems.append(f"{key}=null: must be an integer" + (f" >= {least}" if least is not None else ""))
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(f"{key}={value!r}: must be an integer")
        return None
    if least is not None and value < least:
        problems.append(f"{key}={value}: must be >= {least}")
        return None
    if most is not None and value > most:
        problems.append(f"{key}={value}: must be <= {most}")
        return None
    return value


def _number_key(
    cfg: DictConfig, key: str, problems: list[str], least: float = 0.0, strict: bool = False
) -> float | None:
    """``cfg.<key>`` when it is a finite number >= ``least`` (> with ``strict``; None when unset)."""
    value = OmegaConf.select(cfg, key, default=None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        problems.append(f"{key}={value!r}: must be a finite number")
        return None
    if value < least or (strict and value == least):
        problems.append(f"{key}={value}: must be {'>' if strict else '>='} {least:g}")
        return None
    return float(value)


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value)
