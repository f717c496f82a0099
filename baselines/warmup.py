"""Compile the baselines' numba kernels (UltraEP, LLEP, ForeMoE, MoonEP, ECHO) ahead of time, into numba's
on-disk cache.

The same as :mod:`relibra.planners.warmup` for the planners of ``baselines/``: it plans the tiny batch of
:func:`relibra.planners.warmup.tiny_context` once with each compiled baseline. ``make reproduce`` runs
both (one step per process, :data:`STEPS`) while it plans its grids, so that no worker compiles inside a
cell and no two workers compile the same kernels at once::

    python -m baselines.warmup
"""

from __future__ import annotations

import time
from collections.abc import Callable

from relibra.planners.protocols import Planner
from relibra.planners.warmup import tiny_context

__all__ = ["STEPS", "compile_kernels"]


def _ultraep() -> Planner:
    from baselines.ultraep import UltraEPPlanner

    return UltraEPPlanner(replica_slots=1)


def _llep() -> Planner:
    from baselines.llep import LlepPlanner

    return LlepPlanner()


def _foremoe() -> Planner:
    from baselines.foremoe import ForeMoEPlanner

    return ForeMoEPlanner()


def _moonep() -> Planner:
    from baselines.moonep import MoonEPPlanner

    return MoonEPPlanner()


def _echo() -> Planner:
    from baselines.echo import EchoPlanner

    return EchoPlanner()


STEPS: dict[str, Callable[[], Planner]] = {
    "ultraep": _ultraep,
    "llep": _llep,
    "foremoe": _foremoe,
    "moonep": _moonep,
    "echo": _echo,
}
"""Every baseline with numba kernels -> a planner of it with its default settings (the settings change
values, not the kernels' argument types, so any compile the kernels every cell runs)."""


def compile_kernels(seed: int = 0, steps: tuple[str, ...] = tuple(STEPS)) -> dict[str, float]:
    """Plan :func:`tiny_context` once with each baseline of ``steps``; seconds of each (compile or load)."""
    unknown = [name for name in steps if name not in STEPS]
    if unknown:
        raise ValueError(f"unknown warm-up steps {unknown}; choose from {list(STEPS)}")
    ctx = tiny_context(seed)
    seconds: dict[str, float] = {}
    for name in steps:
        planner = STEPS[name]()
        t0 = time.perf_counter()
        planner.plan(ctx)
        seconds[name] = time.perf_counter() - t0
    return seconds


if __name__ == "__main__":
    done = compile_kernels()
    print("baseline numba kernels ready (" + ", ".join(f"{k} {v:.2f}s" for k, v in done.items()) + ")")
