"""The planner yamls, the generated nodes and the presets' planner sweeps agree with the planner registry
(relibra/planners/registry.py): every card composes to a planner of its name, settings and history, and
every planner a yaml or a preset names has a card."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from experiments.config.planner_nodes import NODES
from experiments.config.resolvers import planners_of
from relibra.planners.protocols import history_need
from relibra.planners.registry import CARDS, PlannerCard, card, in_grid

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf"


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def test_every_planner_yaml_has_a_card_and_every_card_a_yaml() -> None:
    assert sorted(p.stem for p in (CONF / "planner").glob("*.yaml")) == sorted(c.name for c in CARDS)


def test_the_generated_nodes_are_the_cards_with_a_node() -> None:
    base = {name: target for (group, name), target in NODES.items() if group == "planner/base"}
    assert sorted(base) == sorted(c.name for c in CARDS if c.node)
    for name, target in base.items():
        assert f"{target.__module__}.{target.__qualname__}" == card(name).settings


@pytest.mark.parametrize("planner", [c for c in CARDS], ids=lambda c: c.name)
def test_each_yaml_extends_what_its_card_says(planner: PlannerCard) -> None:
    defaults = _yaml(CONF / "planner" / f"{planner.name}.yaml").get("defaults", [])
    if planner.node:
        assert defaults == [f"base/{planner.name}@_here_", "_self_"]
    elif planner.variant_of is not None:
        assert defaults == [planner.variant_of, "_self_"]


def test_every_preset_sweeps_the_planners_its_cards_name() -> None:
    """A preset's planner sweep is ``${planners:<preset>}``, read from the cards (registry order); every grid
    a card names is such a preset; a planner a preset's defaults choose has a card."""
    swept, chosen = {}, []
    for path in sorted((CONF / "experiment").glob("*.yaml")):
        doc = _yaml(path)
        sweep = (((doc.get("hydra") or {}).get("sweeper") or {}).get("params") or {}).get("planner")
        if sweep is not None:
            swept[path.stem] = sweep
        chosen += [d["override /planner"] for d in doc.get("defaults", []) if "override /planner" in d]
    assert len(swept) >= 10
    assert {stem: sweep for stem, sweep in swept.items() if sweep != f"${{planners:{stem}}}"} == {}
    assert sorted({g for c in CARDS for g in c.grids}) == sorted(swept)
    for grid in swept:
        assert planners_of(grid).split(",") == [c.name for c in CARDS if grid in c.grids], grid
    assert [p for p in chosen if p not in {c.name for c in CARDS}] == []


def test_a_grid_no_card_names_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"\$\{planners:nope\}: no planner card names the grid 'nope'"):
        planners_of("nope")
    with pytest.raises(ValueError, match="expected distinct preset names"):
        PlannerCard("x", "x", "static", "a.B", ("none",), grids=("overall", "overall"))


def test_the_overall_sweep_resolves_in_a_composed_preset() -> None:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        conf = compose("config", overrides=["+experiment=quick_overall"], return_hydra_config=True)
    assert conf.hydra.sweeper.params.planner == ",".join(in_grid("overall"))


@pytest.fixture(scope="module")
def composed() -> dict[str, object]:
    """Every card's planner, built as the entry point builds it (``planner=NAME``, its defaults)."""
    out = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for c in CARDS:
            conf = compose(config_name="config", overrides=[f"planner={c.name}"])
            out[c.name] = (conf.planner["_target_"], instantiate(conf.planner, _convert_="all"))
    return out


@pytest.mark.parametrize("planner", [c for c in CARDS], ids=lambda c: c.name)
def test_each_card_composes_to_its_planner(planner: PlannerCard, composed: dict) -> None:
    """The node's ``_target_`` is the card's settings, the planner's name the card's, and it reads history
    exactly when its card says so (the simulator's default window set to 0 so an undeclared need shows)."""
    target, built = composed[planner.name]
    assert target == planner.settings
    assert built.name == planner.name
    assert (history_need(built, 0) > 0) == ("history" in planner.information)
