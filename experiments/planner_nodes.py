"""Config nodes generated from the planners' settings dataclasses, so that each default lives in the
dataclass alone and every one of its keys can still be overridden on the command line.

``planner/reorder/anneal``: the annealer's :class:`~relibra.planners.reorder.AnnealConfig` with
``_target_``; ``planner=relibra`` and ``planner=relibra_reorder_only`` compose it as ``planner.reorder``
(``planner.reorder.KEY=V``). ``planner/majorize/mm``: the replication MILP's
:class:`~relibra.planners.milp.MajorizeConfig` (``cluster.dispatcher=deepep``), composed by
``planner=relibra_milp`` as ``planner.majorize`` (``planner.majorize.KEY=V``). Registered when
:mod:`experiments` is imported, before any composition.
"""

from __future__ import annotations

from dataclasses import asdict

from hydra.core.config_store import ConfigStore

from relibra.planners.milp import MajorizeConfig
from relibra.planners.reorder import AnnealConfig

__all__ = ["register"]


def _node(target: type, settings: object) -> dict[str, object]:
    """``settings`` (a dataclass instance) as a config node that instantiates ``target``."""
    return {"_target_": f"{target.__module__}.{target.__qualname__}", **asdict(settings)}  # type: ignore[call-overload]


def register() -> None:
    """Store the generated nodes in Hydra's config store (idempotent)."""
    ConfigStore.instance().store(
        group="planner/reorder", name="anneal", node=_node(AnnealConfig, AnnealConfig())
    )
    ConfigStore.instance().store(
        group="planner/majorize", name="mm", node=_node(MajorizeConfig, MajorizeConfig())
    )
