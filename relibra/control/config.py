"""How the control plane assembles workloads and runs its workers (:class:`ControlPlaneConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from relibra.layout import LAYOUTS

__all__ = ["ControlPlaneConfig"]


@dataclass(frozen=True)
class ControlPlaneConfig:
    """How the control plane assembles workloads and runs its workers."""

    workers: int = 2
    """Worker processes; 0 plans inline in the coordinator thread (no processes; for debugging)."""
    samples_per_microbatch: int | None = None
    """``K`` samples per GPU per micro-batch (see :func:`relibra.layout.split_microbatches`)."""
    tokens_per_microbatch: int | None = None
    """Or a per-GPU token budget per micro-batch (at most one of the two)."""
    layout: str = LAYOUTS[0]
    """The sample layout (:data:`relibra.layout.LAYOUTS`: ``balanced`` or ``contiguous``)."""
    max_retries: int = 1
    """Re-runs of a task whose worker process died, before its layer falls back."""
    deadline_s: float | None = None
    """Default wait of :meth:`ControlPlane.plans` and :meth:`ControlPlane.plan` (None: until all ready)."""
    mp_context: str = "spawn"
    """Start method of worker processes. NOTE: ``spawn`` because a trainer process holds CUDA state and
    threads, which ``fork`` does not copy safely."""
    seed: int = 0
    """Base seed of batches given through :meth:`ControlPlane.seal`: batch ``b`` plans with seed
    ``seed + b`` (as :func:`relibra.simulator.batch_context` does); :meth:`ControlPlane.plan` uses the
    context's own seed."""
    locality_deadline_s: float | None = None
    """Seconds the locality round may run once a worker started it (None: no own limit); past it, samples
    keep their input GPUs (:attr:`LocalityStatus.TIMED_OUT`)."""
    warm_up: bool = True
    """Plan one small random layer in each worker at start-up (process start, imports, loading the numba
    kernels from their on-disk cache, or compiling them when it is cold)."""

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers={self.workers}; expected >= 0 (0 plans inline)")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}; expected >= 0")
        if self.samples_per_microbatch is not None and self.tokens_per_microbatch is not None:
            raise ValueError("give samples_per_microbatch or tokens_per_microbatch, not both")
        if self.deadline_s is not None and self.deadline_s < 0:
            raise ValueError(f"deadline_s={self.deadline_s}; expected >= 0 or None")
        if self.locality_deadline_s is not None and self.locality_deadline_s < 0:
            raise ValueError(f"locality_deadline_s={self.locality_deadline_s}; expected >= 0 or None")
