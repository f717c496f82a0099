"""A Hydra callback that validates every cell of a ``--multirun`` sweep before the first one runs.

Installed by ``conf/config.yaml`` (``hydra.callbacks.validate_cells``). In ``on_multirun_start`` (the
sweeping process, before the sweeper writes or launches anything) it expands the sweep exactly as Hydra's
basic sweeper will (:func:`experiments.grid.expand`), composes each cell and runs
:func:`experiments.config.validate` on it. A bad cell (``seed=abc``, ``planner.replica_slots=4,999``, an
unreadable trace) is refused with one line naming the cell and the key, and exit status 2, on every
launcher (in-process, ``submitit_local``, Slurm).

NOTE: without it, a cell's ConfigError would travel back to the sweeping process inside the job's result,
where Hydra's sweeper re-raises it (``JobReturn.return_value``) and ``run_and_report`` prints it as a
traceback with exit status 1, after the cells before it have run. Hydra turns an exception raised by a
callback into a warning, so the refusal leaves as ``SystemExit`` (:func:`experiments.config.refuse`), which
Hydra lets through.
"""

from __future__ import annotations

from typing import Any

from hydra import compose
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from experiments.config import ConfigError, refuse, validate
from experiments.grid import expand

__all__ = ["ValidateCells"]


class ValidateCells(Callback):
    """Refuse a sweep with a bad cell before any cell runs (module docstring)."""

    def on_multirun_start(self, config: DictConfig, config_name: str | None = None, **kwargs: Any) -> None:
        node = config.hydra.sweeper.get("params")
        params = OmegaConf.to_container(node, resolve=False) if node is not None else {}
        overrides = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
        assert isinstance(params, dict) and isinstance(overrides, list)
        for cell in expand({str(k): str(v) for k, v in params.items()}, [str(o) for o in overrides]):
            try:
                validate(compose(config_name=config_name, overrides=cell))
            except ConfigError as exc:
                refuse(exc, where=f"cell {' '.join(cell) or '(no overrides)'}: ")
