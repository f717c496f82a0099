"""The yaml's two resolvers: ``${default:KEY}`` (a key's value is the code's default, named, not copied) and
``${planners:GRID}`` (a preset's planner sweep is the registry's list for it).

``${default:KEY}``. A run-wide key that every composition holds (``simulator.history_window``,
``cluster.dispatcher``, ``parallel.dp``, ...) stays in the yaml, so that ``key=value`` overrides it on the
command line and the composed config shows it; its value there is ``${default:KEY}``, which resolves to the
default of the field the run spec types ``KEY`` with (:class:`~experiments.config.spec.RunSpec`: a field
default of the spec, or the library dataclass a node is, e.g. ``simulator.history_window`` ->
:attr:`relibra.simulator.SimOptions.history_window`). The default then lives in one place, the dataclass;
the yaml says where the knob is and what it means. A resolved composition holds the value itself, so what
the results store keys and records is unchanged (docs/experiments.md, "The run spec").

``${planners:GRID}``. A preset's ``hydra.sweeper.params.planner`` is ``${planners:<preset>}``: the planners
whose registry card lists the grid (:func:`relibra.planners.registry.in_grid`), comma-separated in registry
order, as Hydra's sweeper reads a sweep. Putting a planner into a comparison is a line of its card.

Both are registered on import of :mod:`experiments.config` (every path that composes a run config imports
it first).
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

__all__ = ["CONF_DIR", "PLANNERS", "RESOLVER", "default_of", "load_option", "planners_of", "register"]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""The Hydra config groups (``experiments/conf``)."""
RESOLVER = "default"
"""The default resolver's name in the yaml: ``${default:simulator.history_window}``."""
PLANNERS = "planners"
"""The sweep resolver's name in the yaml: ``${planners:overall}``."""


def default_of(key: str) -> Any:
    """The default of the run-spec field at dotted ``key`` (a tuple as a list, as YAML holds it).

    Raises ValueError naming ``key`` when no field is there or the field has no default."""
    from experiments.config.spec import RunSpec, _hints, _nested

    cls: type = RunSpec
    parts = key.split(".")
    for depth, name in enumerate(parts):
        by_name = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        if name not in by_name:
            raise ValueError(f"${{{RESOLVER}:{key}}}: no run-spec field {'.'.join(parts[: depth + 1])}")
        f = by_name[name]
        if depth < len(parts) - 1:
            nested = _nested(_hints(cls)[name])
            if nested is None:
                raise ValueError(f"${{{RESOLVER}:{key}}}: {'.'.join(parts[: depth + 1])} is not a node")
            cls = nested
            continue
        if f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING and not is_dataclass(made := f.default_factory()):
            value = made
        else:
            raise ValueError(f"${{{RESOLVER}:{key}}}: the field has no default value (the yaml must set it)")
        return list(value) if isinstance(value, tuple) else value
    raise ValueError(f"${{{RESOLVER}:{key}}}: an empty key")  # pragma: no cover - split gives one part


def planners_of(grid: str) -> str:
    """The planner sweep of preset ``grid``: the names :func:`~relibra.planners.registry.in_grid` gives,
    comma-separated. Raises ValueError naming the grid when no card lists it."""
    from relibra.planners.registry import in_grid

    try:
        return ",".join(in_grid(grid))
    except KeyError as exc:
        raise ValueError(f"${{{PLANNERS}:{grid}}}: {exc.args[0]}") from None


def register() -> None:
    """Register :func:`default_of` and :func:`planners_of` as OmegaConf resolvers (once per process)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, default_of)
    if not OmegaConf.has_resolver(PLANNERS):
        OmegaConf.register_new_resolver(PLANNERS, planners_of)


def load_option(group: str, name: str) -> dict[str, Any]:
    """One config group option's node as plain data, ``${default:KEY}`` resolved (e.g. ``cluster``,
    ``hopper``: the hardware a table or benchmark prices with, without composing a whole run)."""
    register()
    node: Any = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"), resolve=True)
    return typing.cast(dict[str, Any], node)
