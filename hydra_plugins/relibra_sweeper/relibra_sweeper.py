"""``hydra/sweeper=relibra`` (the suite's default): Hydra's basic sweeper that refuses a bad grid up front.

Hydra's basic sweeper composes every cell of a batch before launching it (``validate_batch_is_legal``)
but checks only that the overrides compose. This sweeper also runs :func:`experiments.config.validate` on
each composed cell, so a sweep with a bad cell (``seed=abc``, ``planner.replica_slots=4,999``, an
unreadable trace) is refused with one line naming the cell and the key, and exit status 2, before any
cell is launched, on every launcher (in-process, ``submitit_local``, Slurm). NOTE: without it, a cell's
ConfigError travels back to the driver inside the job's result and Hydra prints it as a traceback with
exit status 1 (``JobReturn.return_value`` re-raises it in the sweeper, then ``run_and_report`` exits 1).
"""

# NOTE: no `from __future__ import annotations`: Hydra loads plugin modules without registering them in
# sys.modules, where dataclasses cannot resolve string annotations.

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import open_dict


@dataclass
class RelibraSweeperConf(BasicSweeperConf):
    # NOTE: max_batch_size stays null (one batch: the whole grid), so every cell is checked before the
    # first one runs.
    _target_: str = "hydra_plugins.relibra_sweeper.relibra_sweeper.RelibraSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="relibra", node=RelibraSweeperConf, provider="relibra"
)


class RelibraSweeper(BasicSweeper):
    """:class:`BasicSweeper` that validates every cell's config before it writes or launches anything."""

    def sweep(self, arguments: list[str]) -> Any:
        assert self.hydra_context is not None and self.config is not None
        # NOTE: the same expansion BasicSweeper.sweep does next; done first so that a refused sweep
        # leaves the sweep directory (its multirun.yaml) as it was.
        params = [*self._parse_config(), *arguments]
        overrides = OverridesParser.create(config_loader=self.hydra_context.config_loader).parse_overrides(
            params
        )
        for batch in self.split_arguments(overrides, None):
            for cell in batch:
                self._check(cell)
        return super().sweep(arguments)

    def _check(self, overrides: Sequence[str]) -> None:
        from experiments.config import ConfigError, refuse, validate  # NOTE: late: plugins load at startup

        assert self.hydra_context is not None and self.config is not None
        cell = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cell):
            del cell["hydra"]  # the task's config, as the job will see it
        try:
            validate(cell)
        except ConfigError as exc:
            refuse(exc, where=f"cell {' '.join(overrides) or '(no overrides)'}: ")
