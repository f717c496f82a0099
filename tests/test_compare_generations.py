"""scripts/compare_generations.py: the pairs of planners whose step-time ratio moved away from 1 or changed
side between two stores, on hand-made step times."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "compare_generations", REPO / "scripts" / "compare_generations.py"
)
assert _spec is not None and _spec.loader is not None
compare_generations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_generations)


def _times(rows: list[tuple[str, float, float, float]]) -> pd.DataFrame:
    index = pd.MultiIndex.from_tuples([("m", d, 8, 0) for d, *_ in rows], names=compare_generations.CELL)
    return pd.DataFrame([r[1:] for r in rows], index=index, columns=["a", "b", "c"])


def test_a_shared_offset_moves_every_ratio_towards_one_and_a_crossing_is_listed() -> None:
    old = _times([("x", 10.0, 8.0, 12.0), ("y", 10.0, 10.1, 9.0)])
    new = old + 5.0  # the same seconds for every planner: every ratio closer to 1, none crosses
    assert compare_generations.compare(old, new) == (6, 6, [])
    moved = new.copy()
    moved.loc[("m", "y", 8, 0), "b"] = 14.9  # b was slower than a in cell y and is now faster
    total, closer, flipped = compare_generations.compare(old, moved)
    assert (total, closer) == (6, 6)
    assert flipped == [(("m", "y", 8, 0), "a", "b", 1.01, 14.9 / 15.0)]
    away = new.copy()
    away.loc[("m", "x", 8, 0), "c"] = 30.0  # c / a: 1.2 -> 2.0, further from 1
    assert compare_generations.compare(old, away)[1] == 4  # c / a and c / b moved away in cell x
