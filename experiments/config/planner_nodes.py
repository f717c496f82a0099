"""Config nodes generated from the planners' settings dataclasses, so that each default lives in the
dataclass alone and every one of its keys can still be overridden on the command line.

* ``planner/reorder/anneal``: the annealer's :class:`~relibra.planners.reorder.config.AnnealConfig`;
  ``planner=relibra`` and ``planner=relibra_reorder_only`` compose it as ``planner.reorder``
  (``planner.reorder.KEY=V``);
* ``planner/replicate/greedy``: the greedy replication's
:class:`~relibra.planners.replicate.greedy.GreedyConfig`;
  ``planner=relibra`` and ``planner=relibra_replicate_only`` compose it as ``planner.replicate``
  (``planner.replicate.KEY=V``);
* ``planner/replicate/milp``: the exact replication's :class:`~relibra.planners.replicate.milp.MilpConfig`
  (``planner=relibra_milp``);
* ``planner/majorize/mm``: the replication MILP's :class:`~relibra.planners.replicate.milp.MajorizeConfig`,
  the majorize-minimize loop under ``cluster.dispatcher=deepep`` (``planner=relibra_milp``, as
  ``planner.majorize``);
* ``planner/base/<name>``: the settings dataclass of every planner card with ``node=True``
  (:data:`relibra.planners.registry.CARDS`: ``baselines.eplb.EplbPlanner``, ...), every field with its
  default; ``planner=eplb`` and its variants compose it into ``planner`` (``defaults: [base/eplb@_here_]``),
  so ``planner.KEY=V`` reaches the dataclass.

Each node carries ``_target_``, so ``hydra.utils.instantiate`` builds the dataclass. The stage settings hold
no replica slots: a ReLibra planner declares ``replica_slots`` once, beside its stage nodes; a baseline's
slot keys are fields of its dataclass, so they come with its node. Registered when
:mod:`experiments` is imported, before any composition.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict

from hydra.core.config_store import ConfigStore

from relibra.planners.registry import CARDS
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyConfig
from relibra.planners.replicate.milp import MajorizeConfig, MilpConfig

__all__ = ["NODES", "STAGES", "register"]


def _settings(path: str) -> type:
    """The settings dataclass a planner card names by import path (``module.Class``)."""
    module, _, name = path.rpartition(".")
    target = getattr(importlib.import_module(module), name)
    if not isinstance(target, type):
        raise TypeError(
            f"planner card settings {path}: {target!r} is not a class; a card with node=True names one"
        )
    return target


STAGES: dict[tuple[str, str], type] = {
    ("planner/reorder", "anneal"): AnnealConfig,
    ("planner/replicate", "greedy"): GreedyConfig,
    ("planner/replicate", "milp"): MilpConfig,
    ("planner/majorize", "mm"): MajorizeConfig,
}
"""ReLibra's stage nodes (not planners: the compositions' yamls compose them)."""

NODES: dict[tuple[str, str], type] = STAGES | {
    ("planner/base", c.name): _settings(c.settings) for c in CARDS if c.node
}
"""(group, name) -> the settings dataclass its node is generated from (with that class's defaults)."""


def _node(target: type) -> dict[str, object]:
    """The defaults of ``target`` (a dataclass of scalars and tuples) as a node that instantiates it."""
    # NOTE: the one place that reads a planner dataclass's fields, once at import to write its config; no
    # caller reads a planner's fields at run time (they use its Protocol). OmegaConf.structured would type
    # the node too, but it does not support the Literal fields the planners use.
    return {"_target_": f"{target.__module__}.{target.__qualname__}", **asdict(target())}


def register() -> None:
    """Store the generated nodes in Hydra's config store (idempotent)."""
    store = ConfigStore.instance()
    for (group, name), target in NODES.items():
        store.store(group=group, name=name, node=_node(target))
