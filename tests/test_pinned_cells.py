"""Behaviour pins: one small cell per planner config is bit-identical to ``tests/data/pinned_cells.json``.

A refactor must not change any result; a change meant to alter results re-records the pins
(``python scripts/pin_cells.py --write [--slow]``) and says why in its commit.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pin_cells", REPO / "scripts" / "pin_cells.py")
assert _spec is not None and _spec.loader is not None
pin_cells = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pin_cells)

PINNED = json.loads((REPO / "tests" / "data" / "pinned_cells.json").read_text())
SLOW = json.loads((REPO / "tests" / "data" / "pinned_slow.json").read_text())


def test_every_planner_config_is_pinned() -> None:
    assert sorted(PINNED["metrics"]) == pin_cells.planner_configs()
    assert PINNED["overrides"] == pin_cells.small_cells()


@pytest.mark.parametrize("name", sorted(PINNED["metrics"]))
def test_small_cell_is_unchanged(name: str) -> None:
    assert pin_cells.measure(PINNED["overrides"][name]) == PINNED["metrics"][name]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW["metrics"]))
def test_quick_scale_cell_is_unchanged(name: str) -> None:
    assert pin_cells.measure(SLOW["overrides"][name]) == SLOW["metrics"][name]
