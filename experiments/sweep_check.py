"""A Hydra callback that checks every cell of a ``--multirun`` sweep before the first one runs, and
ends the sweep with a summary of every cell that failed.

Installed by ``conf/config.yaml`` (``hydra.callbacks.check_cells``). In ``on_multirun_start`` (the sweeping
process, before the sweeper writes or launches anything) it expands the sweep exactly as Hydra's basic sweeper
will (:func:`experiments.config.presets.expand`), composes each cell and runs
:func:`experiments.config.checks.check_config` on it. A bad cell (``seed=abc``,
``planner.replica_slots=4,999``, an unreadable trace) is refused with one line naming the cell and the key,
and exit status 2, on every launcher (in-process, ``submitit_local``, Slurm).

NOTE: without it, a cell's ConfigError would travel back to the sweeping process inside the job's result,
where Hydra's sweeper re-raises it (``JobReturn.return_value``) and ``run_and_report`` prints it as a
traceback with exit status 1, after the cells before it have run. Hydra turns an exception raised by a
callback into a warning, so the refusal leaves as ``SystemExit`` (:func:`experiments.config.errors.refuse`),
which Hydra lets through.

Failures: a cell that fails while it runs (a full disk, a planner error) is reported by the task function
(:func:`experiments.run.main`) as one line and a :class:`CellFailure` return value, also written to
``failed.json`` in the cell's folder when that can be written, instead of an exception: Hydra's basic
sweeper re-raises only the first failed cell's exception once the batch is done, so the other failures
would go unreported. ``on_job_end`` collects the failures of cells run in this process and
``on_multirun_end`` the ``failed.json`` of cells run elsewhere (Slurm), then prints every failed cell
with its reason and exits with status 1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra import compose
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError, refuse
from experiments.config.presets import expand
from experiments.store.run_dir import note_new_dirs

__all__ = ["FAILED_FILE", "CellFailure", "CheckCells"]

FAILED_FILE = "failed.json"
"""Written into a failed cell's folder: ``{"cell": "<overrides>", "error": "<reason>"}``."""


@dataclass(frozen=True)
class CellFailure:
    """What the task function returns for a cell that failed while it ran (module docstring)."""

    cell: str
    """The cell's overrides, space-separated."""
    error: str
    """One line: the exception's type and message."""


class CheckCells(Callback):
    """Refuse a sweep with a bad cell before any cell runs; summarise failed cells at its end."""

    def __init__(self) -> None:
        self.failures: dict[str, str] = {}

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        value = job_return._return_value  # NOTE: the property re-raises a failed job's exception
        if isinstance(value, CellFailure):
            self.failures[value.cell] = value.error
        elif job_return.status == JobStatus.FAILED:
            cell = " ".join(job_return.overrides or [])
            self.failures[cell] = f"{type(value).__name__}: {value}"

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        for path in sorted(sweep_dir.glob(f"*/{FAILED_FILE}")):
            try:
                record = json.loads(path.read_text())
                self.failures.setdefault(str(record["cell"]), str(record["error"]))
            except (OSError, ValueError, KeyError, TypeError):
                self.failures.setdefault(str(path.parent), f"unreadable failure record {path}")
        if not self.failures:
            return
        print(f"relibra-run: {len(self.failures)} cell(s) of the sweep failed:", file=sys.stderr)
        for cell, error in self.failures.items():
            print(f"  {cell or '(no overrides)'}: {error}", file=sys.stderr)
        raise SystemExit(1)

    def on_run_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        """A single run: refused here, before Hydra makes its run directory (a refusal leaves none)."""
        note_new_dirs(Path(str(config.hydra.run.dir)))
        overrides = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        assert isinstance(overrides, list)
        try:
            check_config(compose(config_name=config_name, overrides=[str(o) for o in overrides]))
        except ConfigError as exc:
            refuse(exc)

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        node = config.hydra.sweeper.get("params")
        params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
        overrides = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        assert isinstance(params, dict) and isinstance(overrides, list)
        for cell in expand({str(k): str(v) for k, v in params.items()}, [str(o) for o in overrides]):
            try:
                check_config(compose(config_name=config_name, overrides=cell))
            except ConfigError as exc:
                refuse(exc, where=f"cell {' '.join(cell) or '(no overrides)'}: ")
