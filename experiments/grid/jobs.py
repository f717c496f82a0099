"""What the main job's runner hands around: a preset's grid report, one cell's job and its outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from experiments.config.spec import RunSpec

__all__ = ["CellJob", "CellOutcome", "GridReport"]


@dataclass
class GridReport:
    """What happened to one preset's cells."""

    preset: str
    ran: int = 0
    copied: int = 0
    """Cells identical to one another preset computed in this run (same key): their rows were copied."""
    reused: int = 0
    stale: dict[str, int] = field(default_factory=dict)
    """Reused cells computed by other code than the current one: their ``code_version`` -> count."""
    failed: list[tuple[list[str], str]] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    """Cell files found unreadable; each was computed again (or is listed in ``failed``)."""
    skipped: str = ""
    total: int = 0
    """Cells in the preset's grid."""
    left_out: int = 0
    """Finished cells of the grid recorded before this run that its grid leaves out (the analysis then
    leaves them out too): a changed setting, or overrides that narrow the sweep without ``--extend-grid``."""
    grid_replaced: str = ""
    """Why the ``grid.json`` found was unreadable (empty: it was fine or absent); this run's grid replaced
    it, so cells it left out cannot be counted in ``left_out``."""
    rekeyed: int = 0
    """Finished cells of the grid recorded before that were keyed by an earlier rule (their trace file's
    path, before cells that read a trace were keyed by its content; a peer trace's folder, before it left
    the key): the grid wants them under their current keys, so they are computed once more; the old files
    stay on disk."""


@dataclass(frozen=True)
class CellJob:
    """One cell that has to be computed: what :func:`run_cell_job` needs, picklable for a worker process."""

    preset: str
    cell: list[str]
    label: str
    """``model dataset EPn planner``: how progress lines name the cell."""
    spec: RunSpec | str
    """The cell's checked run spec, or why :func:`~experiments.config.checks.check_config` refused its
    config when the grid was planned (the cell fails with it, nothing is computed); a spec runs unchecked."""
    run_dir: Path
    recompute: bool
    """The cell is stored already (by other code) and is computed again."""
    key: str
    """The cell's :func:`~experiments.store.keys.cell_key`: jobs with equal keys are one computation."""


@dataclass(frozen=True)
class CellOutcome:
    """What one computed cell came to: its wall seconds and, when it failed, why."""

    seconds: float
    error: str | None = None
    copied_from: str | None = None
    """The preset whose identical cell (same key) this one's rows were copied from; None: computed."""
    trace_generated: bool = False
    """The cell built its counts (a miss of the worker's cache, :mod:`experiments.inputs`)."""
    workload_built: bool = False
    """The cell laid out its workload (a miss of the worker's cache)."""
    read_back: bool = False
    """Nothing was computed: another run of the same store finished the cell after this one planned it,
    and the cell was read back (counted as reused, not as computed)."""
