"""The planner registry: well-formed cards, and the labels, colours and figure order the analysis drew
before the registry existed, kept exactly (tests/experiments/test_registry_configs.py holds the yamls, nodes
and presets to it)."""

from __future__ import annotations

import pytest

from relibra.planners import registry
from relibra.planners.registry import CARDS, PlannerCard

OLD_LABELS = {
    "megatron": "Megatron-LM",
    "popfetcher": "PopFetcher",
    "eplb": "EPLB+",
    "lplb": "LPLB+",
    "balanced": "Balanced",
    "force_balanced": "force-balanced",
    "relibra": "ReLibra (paper)",
    "relibra_balance": "ReLibra (balance-first)",
    "relibra_portfolio": "ReLibra (recommended)",
    "relibra_no_locality": "ReLibra without its locality round",
    "relibra_reorder_no_locality": "+ inter-batch reordering (placement only)",
    "relibra_reorder_only": "+ locality round (the paper's + inter-batch reordering)",
    "relibra_replicate_only": "+ intra-batch replication only",
    "ultraep": "UltraEP",
    "llep": "LLEP",
    "moonep": "MoonEP",
    "echo": "ECHO",
    "foremoe": "ForeMoE",
}
"""``analysis.paper.BASELINE_LABELS`` as it was before the registry (at b336aff)."""

OLD_ORDER = [
    "megatron",
    "popfetcher",
    "eplb",
    "lplb",
    "llep",
    "ultraep",
    "moonep",
    "echo",
    "relibra_reorder_no_locality",
    "relibra_reorder_only",
    "relibra_replicate_only",
    "relibra",
    "relibra_balance",
    "relibra_portfolio",
    "foremoe",
    "relibra_no_locality",
    "force_balanced",
    "balanced",
]
"""``analysis.figures.PLANNER_ORDER`` before the registry."""

OLD_COLOURS = {
    "megatron": ("colorblind", 7),
    "popfetcher": ("colorblind", 5),
    "eplb": ("colorblind", 8),
    "lplb": ("dark", 8),
    "llep": ("colorblind", 2),
    "ultraep": ("colorblind", 9),
    "moonep": ("dark", 2),
    "echo": ("pastel", 2),
    "relibra_reorder_no_locality": ("pastel", 4),
    "relibra_reorder_only": ("colorblind", 4),
    "relibra_replicate_only": ("pastel", 0),
    "relibra": ("colorblind", 0),
    "relibra_balance": ("colorblind", 6),
    "relibra_portfolio": ("dark", 0),
    "foremoe": ("colorblind", 3),
    "relibra_no_locality": ("dark", 4),
    "force_balanced": ("dark", 7),
    "balanced": ("colorblind", 1),
}
"""``analysis.figures.PLANNER_COLOURS`` before the registry."""


def test_old_labels_colours_and_order_are_kept() -> None:
    """Every planner the analysis named keeps its label, colour and relative figure order; every other
    registered planner's label is its name (as ``paper.label`` fell back to) unless it is new."""
    labels = registry.labels()
    assert {p: labels[p] for p in OLD_LABELS} == OLD_LABELS
    before = set(OLD_LABELS) | set(OLD_COLOURS)
    for name in ("eplb_global", "eplb_history", "eplb_periodic", "relibra_keep_placement", "relibra_milp"):
        assert name not in before and labels[name] == name
    colours = registry.colours()
    assert {p: colours[p] for p in OLD_COLOURS} == OLD_COLOURS
    assert [p for p in registry.figure_order() if p in OLD_COLOURS] == OLD_ORDER
    assert registry.label("not_a_planner") == "not_a_planner"


def test_cards_are_unique() -> None:
    """One card per name, one colour per planner, one label per planner (a figure's legend keys on it)."""
    names = [c.name for c in CARDS]
    assert len(set(names)) == len(names)
    colours = [c.colour for c in CARDS if c.colour is not None]
    assert len(set(colours)) == len(colours)
    assert len({c.label for c in CARDS}) == len(CARDS)
    assert registry.figure_order() == [c.name for c in CARDS if c.colour is not None]


def test_variants_extend_a_registered_card_with_its_settings() -> None:
    for c in CARDS:
        if c.variant_of is not None:
            base = registry.card(c.variant_of)
            assert base.settings == c.settings, c.name
            assert base.family == c.family, c.name


def test_families_and_information() -> None:
    """Each family is held by some planner; the analysis' online and replay-based rows are of theirs."""
    from analysis.tables import ONLINE_BASELINES, REPLAY_BASED

    assert {c.family for c in CARDS} == set(registry.FAMILIES)
    assert all(registry.card(p).family == "online" for p in ONLINE_BASELINES)
    assert all(registry.card(p).family == "replay" for p in REPLAY_BASED)
    assert set(registry.names("bound")) == {"balanced", "force_balanced"}


def test_a_bad_card_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="planner card x: family='dynamic'"):
        PlannerCard("x", "X", "dynamic", "m.X", ("none",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"planner card x: information=.*expected one or more"):
        PlannerCard("x", "X", "static", "m.X", ("oracle",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="planner card x: information"):
        PlannerCard("x", "X", "static", "m.X", ())
    with pytest.raises(ValueError, match=r"a variant .* has no node"):
        PlannerCard("x", "X", "static", "m.X", ("none",), node=True, variant_of="eplb")
    with pytest.raises(KeyError, match="planner 'x' is not registered; registered: megatron"):
        registry.card("x")
