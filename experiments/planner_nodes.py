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
* ``planner/base/<baseline>``: a baseline planner's dataclass (``baselines.eplb.EplbPlanner``, ...), every
  field with its default; ``planner=eplb`` and its variants compose it into ``planner``
  (``defaults: [base/eplb@_here_]``), so ``planner.KEY=V`` reaches the dataclass.

Each node carries ``_target_``, so ``hydra.utils.instantiate`` builds the dataclass. The stage settings hold
no replica slots: a ReLibra planner declares ``replica_slots`` once, beside its stage nodes; a baseline's
slot keys are fields of its dataclass, so they come with its node. Registered when
:mod:`experiments` is imported, before any composition.
"""

from __future__ import annotations

from dataclasses import asdict

from hydra.core.config_store import ConfigStore

from baselines.balanced import BalancedBound
from baselines.echo import EchoPlanner
from baselines.eplb import EplbPlanner
from baselines.eplb_periodic import EplbPeriodicPlanner
from baselines.foremoe import ForeMoEPlanner
from baselines.llep import LlepPlanner
from baselines.lplb import LplbPlanner
from baselines.megatron import MegatronPlanner
from baselines.moonep import MoonEPPlanner
from baselines.popfetcher import PopFetcherPlanner
from baselines.ultraep import UltraEPPlanner
from relibra.planners.reorder.config import AnnealConfig
from relibra.planners.replicate.greedy import GreedyConfig
from relibra.planners.replicate.milp import MajorizeConfig, MilpConfig

__all__ = ["NODES", "register"]

NODES: dict[tuple[str, str], type] = {
    ("planner/reorder", "anneal"): AnnealConfig,
    ("planner/replicate", "greedy"): GreedyConfig,
    ("planner/replicate", "milp"): MilpConfig,
    ("planner/majorize", "mm"): MajorizeConfig,
    ("planner/base", "balanced"): BalancedBound,
    ("planner/base", "echo"): EchoPlanner,
    ("planner/base", "eplb"): EplbPlanner,
    ("planner/base", "eplb_periodic"): EplbPeriodicPlanner,
    ("planner/base", "foremoe"): ForeMoEPlanner,
    ("planner/base", "llep"): LlepPlanner,
    ("planner/base", "lplb"): LplbPlanner,
    ("planner/base", "megatron"): MegatronPlanner,
    ("planner/base", "moonep"): MoonEPPlanner,
    ("planner/base", "popfetcher"): PopFetcherPlanner,
    ("planner/base", "ultraep"): UltraEPPlanner,
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
