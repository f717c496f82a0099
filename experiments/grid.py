"""An experiment preset's grid: its cells' overrides and composed configs, without launching anything.

A preset (``conf/experiment/<name>.yaml``) lists its sweep under ``hydra.sweeper.params``; the cells are
the cartesian product of those values, expanded exactly as Hydra's basic sweeper does
(``BasicSweeper.split_arguments``), with any extra overrides (sweeps included) taking precedence over the
preset's. ``python -m experiments.run -m +experiment=<name>`` launches the same cells through Hydra.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

__all__ = ["CONF_DIR", "Cell", "cells", "compose_cell", "compose_cells", "expand", "presets"]

CONF_DIR = Path(__file__).resolve().parent / "conf"

Cell = list[str]
"""One grid cell: the overrides (``key=value``) that pick it out of the preset."""


def presets() -> list[str]:
    """Names of every experiment preset (``conf/experiment/*.yaml``), sorted."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@contextmanager
def _hydra() -> Iterator[None]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="relibra"):
        yield


def _check(experiment: str) -> None:
    if experiment not in presets():
        raise ValueError(f"unknown experiment preset {experiment!r}; choose one of {presets()}")


def cells(experiment: str, overrides: Sequence[str] = ()) -> list[Cell]:
    """The preset's grid cells, in Hydra's sweep order (``overrides`` replace or extend the sweep)."""
    _check(experiment)
    with _hydra():
        cfg = compose("config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    return expand(dict(cfg.hydra.sweeper.params or {}), overrides)


def expand(params: Mapping[str, str], overrides: Sequence[str] = ()) -> list[Cell]:
    """The cells of a sweep: ``hydra.sweeper.params`` and the command line's ``overrides`` (sweeps
    included, taking precedence), expanded as Hydra's basic sweeper does."""
    parsed = OverridesParser.create().parse_overrides([*(f"{k}={v}" for k, v in params.items()), *overrides])
    return BasicSweeper.split_arguments(parsed, None)[0]


def compose_cell(experiment: str, cell: Sequence[str] = ()) -> DictConfig:
    """The resolved-on-access run config of one cell of ``experiment`` (what ``run(cfg)`` takes)."""
    _check(experiment)
    with _hydra():
        return compose("config", overrides=[f"+experiment={experiment}", *cell])


SEED = "seed"
"""The trace seed: a plain value at the config's root (``conf/config.yaml``), never a config group."""


def compose_cells(experiment: str, grid: Sequence[Sequence[str]]) -> list[DictConfig]:
    """``compose_cell`` for many cells at once (one Hydra initialisation instead of one per cell).

    Cells that differ only in their trace seed share one composition: the first is composed by Hydra, the
    others are its copy with ``seed`` set to the value Hydra's override parser reads from their
    ``seed=...`` override (the same config; tests/experiments/test_grid.py composes both ways). Hydra's
    composition is most of a grid's planning time and the paper-scale presets run three seeds.
    """
    _check(experiment)
    parser = OverridesParser.create()
    by_rest: dict[tuple[str, ...], DictConfig] = {}
    out = []
    with _hydra():
        for cell in grid:
            seeds = [o for o in cell if o.split("=", 1)[0] == SEED]
            seed = parser.parse_override(seeds[0]).value() if len(seeds) == 1 else None
            shareable = isinstance(seed, int) and not isinstance(seed, bool)
            rest = tuple(o for o in cell if o not in seeds)
            base = by_rest.get(rest) if shareable else None
            if base is None:
                cfg = compose("config", overrides=[f"+experiment={experiment}", *cell])
                if shareable:
                    by_rest[rest] = cfg
            else:
                cfg = copy.deepcopy(base)
                cfg[SEED] = seed
            out.append(cfg)
    return out
