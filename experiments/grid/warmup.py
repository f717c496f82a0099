"""Every numba kernel compiled into numba's on-disk cache before the main job's worker processes start,
in spawned processes of its own, beside the grid planning.

On a fresh clone the cache is cold: a worker that meets a kernel first compiles it inside a cell (seconds
to tens of seconds), and two workers that meet it at once both compile it. :func:`warming` compiles the
steps of :data:`STEPS` (ReLibra's planners, :mod:`relibra.planners.warmup`; each compiled baseline,
:mod:`baselines.warmup`) in ``min(workers, 2)`` processes, ReLibra's alone in the first (it is the
longest), while ``experiments.reproduce`` composes and checks its grids in the parent; the workers then
only load the cache.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["STEPS", "WarmupError", "compile_steps", "groups", "warming"]

RELIBRA = "relibra"
"""The step that compiles ReLibra's planners' kernels (:func:`relibra.planners.warmup.compile_kernels`)."""


def _baselines() -> tuple[str, ...]:
    from baselines.warmup import STEPS as BASELINES

    return tuple(BASELINES)


STEPS: tuple[str, ...] = (RELIBRA, *_baselines())
"""Every warm-up step: ReLibra's planners, then each compiled baseline (:data:`baselines.warmup.STEPS`)."""


class WarmupError(RuntimeError):
    """A warm-up process failed (its traceback is on stderr): a kernel does not compile."""


def compile_steps(steps: tuple[str, ...]) -> None:
    """Compile (or load from the cache) the kernels of ``steps``, in this process."""
    from baselines.warmup import compile_kernels as compile_baselines
    from relibra.planners.warmup import compile_kernels

    if RELIBRA in steps:
        compile_kernels()
    if rest := tuple(step for step in steps if step != RELIBRA):
        compile_baselines(steps=rest)


def groups(processes: int) -> list[tuple[str, ...]]:
    """:data:`STEPS` in ``processes`` groups (at least 1): ReLibra's step alone in the first when there are
    several, the baselines dealt over the others in turn."""
    if processes <= 1:
        return [STEPS]
    rest = STEPS[1:]
    n = min(processes - 1, len(rest))
    return [(RELIBRA,), *(rest[i::n] for i in range(n))]


@contextmanager
def warming(workers: int) -> Iterator[None]:
    """Compile every kernel in ``min(workers, 2)`` spawned processes while the body runs; when it ends, wait
    for them (raise :class:`WarmupError` when one failed). ``workers <= 1``: nothing (a single process
    compiles what its cells need as it meets it). A body that raises stops the processes at once."""
    if workers <= 1:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    split = groups(min(workers, 2))
    procs = [ctx.Process(target=compile_steps, args=(group,), daemon=True) for group in split]
    for proc in procs:
        proc.start()
    try:
        yield
    except BaseException:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()
        raise
    failed = []
    for proc, group in zip(procs, split, strict=True):
        proc.join()
        if proc.exitcode != 0:
            failed.append(f"{', '.join(group)} (exit status {proc.exitcode})")
    if failed:
        raise WarmupError(f"numba warm-up failed: {'; '.join(failed)}; see the traceback above")
