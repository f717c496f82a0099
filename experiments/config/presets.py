"""An experiment preset's grid: its cells' overrides and composed configs, without launching anything.

A preset (``conf/experiment/<name>.yaml``) lists its sweep under ``hydra.sweeper.params``; the cells are
the cartesian product of those values, expanded exactly as Hydra's basic sweeper does
(``BasicSweeper.split_arguments``, re-done on Hydra's public override parser), with any extra overrides
(sweeps included) taking precedence over the preset's. ``python -m experiments.run -m +experiment=<name>``
launches the same cells through Hydra.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from experiments.config.resolvers import CONF_DIR

__all__ = ["CONF_DIR", "Cell", "cells", "compose_cell", "compose_cells", "expand", "presets"]


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
    included, taking precedence), expanded as Hydra's basic sweeper does (its ``split_arguments``: each key
    in its first place with its last value, then the cartesian product), read with Hydra's public
    ``OverridesParser`` and ``Override`` API. Raises HydraException for an interval sweep, which the basic
    sweeper refuses too."""
    parsed = OverridesParser.create().parse_overrides([*(f"{k}={v}" for k, v in params.items()), *overrides])
    choices: dict[str, list[str]] = {}  # NOTE: a key keeps its first place and takes its last value
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            choices[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif override.is_discrete_sweep():
            choices[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            raise HydraException(f"{key}: the basic sweeper sweeps a list of choices, not an interval")
    return [list(cell) for cell in itertools.product(*choices.values())]


def compose_cell(experiment: str, cell: Sequence[str] = ()) -> DictConfig:
    """The resolved-on-access run config of one cell of ``experiment`` (what ``run(cfg)`` takes), composed
    by Hydra itself: the reference :func:`compose_cells` is tested against."""
    _check(experiment)
    with _hydra():
        return compose("config", overrides=[f"+experiment={experiment}", *cell])


def compose_cells(experiment: str, grid: Sequence[Sequence[str]]) -> list[DictConfig]:
    """:func:`compose_cell` of every cell of ``grid``, from one Hydra composition of the preset.

    Hydra composes the preset once (its base config) and once more for each config group option a cell
    chooses (``planner=relibra``: that composition's ``planner`` node). A cell is a copy of the base with
    the nodes of the options it chooses put in place, then its ``key=value`` overrides set by Hydra's own
    rule for them (``OmegaConf.update(cfg, key, value, merge=True)``, after every group option, whatever
    their order on the command line). Composing a preset's cell takes Hydra about 0.2 s of CPU (most of a
    grid's planning time); a copy takes a few milliseconds.

    A cell is composed by Hydra itself (the same config, only slower) when it uses what this does not
    reproduce: an override other than ``key=value`` (``+key``, ``~key``, ``group@package``, a list of
    options), a ``hydra`` key, a nested group (``planner/reorder=...``), an option whose composition
    differs from the base outside its own node, or an override Hydra would refuse (so that the error is
    Hydra's). tests/experiments/test_grid.py composes every cell of the quick presets both ways.
    """
    _check(experiment)
    parser = OverridesParser.create()
    with _hydra():
        composer = _Composer(experiment)
        return [composer.cell(list(cell), parser) for cell in grid]


class _Composer:
    """One preset's base composition and its group options' nodes, composed on first use."""

    def __init__(self, experiment: str) -> None:
        self.experiment = experiment
        self.groups = frozenset(GlobalHydra.instance().config_loader().list_groups(""))
        """The config groups at the root (Hydra reads ``key=value`` as a group option when ``key`` is one)."""
        self._base: DictConfig | None = None
        self._base_tree: dict[str, Any] | None = None
        self._options: dict[tuple[str, str], DictConfig | None] = {}
        """``(group, option)`` -> the option's node, or None: the option's composition changes the
        config outside that node too, so its cells are composed by Hydra."""

    def _compose(self, overrides: Sequence[str]) -> DictConfig:
        return compose("config", overrides=[f"+experiment={self.experiment}", *overrides])

    def _tree(self) -> dict[str, Any]:
        if self._base is None or self._base_tree is None:
            self._base = self._compose([])
            self._base_tree = _container(self._base)
        return self._base_tree

    def _option(self, group: str, option: str) -> DictConfig | None:
        if (group, option) not in self._options:
            base = self._tree()
            cfg = self._compose([f"{group}={option}"])
            tree = _container(cfg)
            alone = {k: v for k, v in tree.items() if k != group} == {
                k: v for k, v in base.items() if k != group
            } and list(tree) == list(base)
            self._options[group, option] = cfg[group] if alone and group in cfg else None
        return self._options[group, option]

    def cell(self, cell: Cell, parser: OverridesParser) -> DictConfig:
        """The cell's config (see :func:`compose_cells`)."""
        try:
            parsed = parser.parse_overrides(cell)
        except Exception:  # NOTE: Hydra's parser error, raised by Hydra's own composition below
            return self._compose(cell)
        if not all(_plain_change(o) for o in parsed):
            return self._compose(cell)
        groups = [o for o in parsed if o.key_or_group in self.groups]
        nodes = []
        for o in groups:
            value = o.value()
            node = self._option(o.key_or_group, value) if isinstance(value, str) else None
            if node is None:
                return self._compose(cell)
            nodes.append((o.key_or_group, node))
        if len({group for group, _ in nodes}) < len(nodes):  # NOTE: Hydra refuses a group chosen twice
            return self._compose(cell)
        self._tree()
        cfg = copy.deepcopy(self._base)
        assert cfg is not None
        try:
            for group, node in nodes:
                cfg[group] = node  # NOTE: OmegaConf copies an assigned node (never shared between cells)
            for o in parsed:
                if o.key_or_group not in self.groups:
                    OmegaConf.update(cfg, o.key_or_group, o.value(), merge=True)
        except Exception:  # NOTE: e.g. a key not in the config: Hydra's composition raises its own error
            return self._compose(cell)
        return cfg


def _container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _plain_change(o: Override) -> bool:
    """``key=value`` or ``group=option``: no ``+``/``++``/``~``, no package, no sweep, no ``hydra`` key,
    no nested group."""
    key = o.key_or_group
    return (
        o.type == OverrideType.CHANGE
        and o.package is None
        and not o.is_sweep_override()
        and key.split(".", 1)[0].split("/", 1)[0] != "hydra"
        and "/" not in key
    )
