"""Compile the baselines' numba kernels (UltraEP, LLEP) ahead of time, into numba's on-disk cache.

The same as :mod:`relibra.planners.warmup` for the planners of ``baselines/``: it plans the tiny batch of
:func:`relibra.planners.warmup.tiny_context` once with each compiled baseline. ``make reproduce`` runs
both before it starts worker processes, so that no two workers compile the same kernels at once::

    python -m baselines.warmup
"""

from __future__ import annotations

import time

from relibra.planners.warmup import tiny_context

__all__ = ["compile_kernels"]


def compile_kernels(seed: int = 0) -> dict[str, float]:
    """Plan :func:`tiny_context` once with UltraEP and with LLEP; seconds of each (compile or load)."""
    from baselines.llep import LlepPlanner
    from baselines.ultraep import UltraEPPlanner

    ctx = tiny_context(seed)
    seconds: dict[str, float] = {}
    for name, planner in (("ultraep", UltraEPPlanner(replica_slots=1)), ("llep", LlepPlanner())):
        t0 = time.perf_counter()
        planner.plan(ctx)
        seconds[name] = time.perf_counter() - t0
    return seconds


if __name__ == "__main__":
    steps = compile_kernels()
    print("baseline numba kernels ready (" + ", ".join(f"{k} {v:.2f}s" for k, v in steps.items()) + ")")
