"""Every planner config instantiates to an object that declares its seams (no introspection needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate

import experiments  # noqa: F401  (registers the generated config nodes)
from experiments.config.planner_nodes import NODES
from relibra.planners.protocols import Planner, PlannerPortfolio, SlotBudget, StagedPlanner
from relibra.planners.replicate.greedy import GreedyConfig
from relibra.planners.replicate.milp import MilpConfig
from relibra.simulator import Bound

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"
NAMES = sorted(p.stem for p in (CONF / "planner").glob("*.yaml"))
WHOLE_BATCH_RELIBRA = ("relibra_reorder_only", "relibra_reorder_no_locality", "relibra_portfolio")


@pytest.mark.parametrize("name", NAMES)
def test_planner_declares_its_slot_budget(name: str) -> None:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"planner={name}"]).planner
    planner = instantiate(cfg, _convert_="all")
    assert isinstance(planner, Planner) != isinstance(planner, Bound), name
    budget = planner.slot_budget
    assert isinstance(budget, SlotBudget)
    assert budget.replica_slots == int(cfg.get("replica_slots", 0))
    assert budget.redundant_slots == int(cfg.get("redundant_slots", 0))
    staged = name.startswith("relibra") and name not in WHOLE_BATCH_RELIBRA
    assert isinstance(planner, StagedPlanner) == staged
    assert isinstance(planner, PlannerPortfolio) == (name == "relibra_portfolio")
    if isinstance(planner, StagedPlanner):
        assert planner.replicator.replica_slots == budget.replica_slots
        assert planner.replicator.with_slots(0).replica_slots == 0
    if isinstance(planner, PlannerPortfolio):
        candidates = planner.candidate_planners()
        assert len(candidates) == 3
        assert planner.with_candidates(candidates[:1]).candidate_planners() == candidates[:1]


@pytest.mark.parametrize(("group", "node"), sorted(NODES))
def test_generated_node_is_its_dataclass_with_its_defaults(group: str, node: str) -> None:
    """The nodes of experiments/config/planner_nodes.py hold each default once: built, they equal the class's
    own."""
    cfg = ConfigStore.instance().load(f"{group}/{node}.yaml").node
    assert instantiate(cfg, _convert_="all") == NODES[(group, node)]()


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("relibra", GreedyConfig()),
        ("relibra_replicate_only", GreedyConfig()),
        ("relibra_balance", GreedyConfig(acceptance="compute")),
        ("relibra_milp", MilpConfig()),
    ],
)
def test_replicate_block_is_the_dataclass_with_the_preset_overrides(name: str, expected: object) -> None:
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"planner={name}", "planner.replica_slots=3"]).planner
    assert "replica_slots" not in cfg.replicate  # declared once, beside the stages
    planner = instantiate(cfg, _convert_="all")
    assert planner.replicator.config == expected and planner.replicator.replica_slots == 3
