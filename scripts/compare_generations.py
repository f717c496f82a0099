"""How the planners' step-time ratios moved between two results stores of the same grids.

Usage: ``python scripts/compare_generations.py OLD_ROOT NEW_ROOT [--presets overall,nvl72,...]``.

For each preset both roots hold, every pair of planners is compared within each cell they share (same
model, dataset, EP size and trace seed): the ratio of their step times in the old store against the new
one. Prints, per preset, the pairs compared, how many moved closer to 1 (or stayed), and each pair whose
faster planner changed (the ratio crossed 1), with both ratios. A change that adds the same seconds to
every planner's step (docs/results/README.md, results generation 5) should move every ratio towards 1.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.store.access import load_experiment  # noqa: E402
from experiments.store.pair import parse_store_pair  # noqa: E402

CELL = ["model", "dataset", "nodes", "seed"]
"""What makes two rows the same cell for a ratio between planners."""


def step_times(root: Path, preset: str) -> pd.DataFrame:
    """float64 [cells, planners]: step seconds of each planner in each cell of ``root/preset``."""
    frame = load_experiment(root / preset)
    return frame.pivot_table(index=CELL, columns="planner", values="step_time_s")


def compare(
    old: pd.DataFrame, new: pd.DataFrame
) -> tuple[int, int, list[tuple[object, str, str, float, float]]]:
    """(pairs compared, pairs whose ratio is as close to 1 or closer, the pairs that changed side)."""
    cells = old.index.intersection(new.index)
    planners = sorted(set(old.columns) & set(new.columns))
    total = closer = 0
    flipped = []
    for a, b in itertools.combinations(planners, 2):
        before = (old.loc[cells, b] / old.loc[cells, a]).dropna()
        after = (new.loc[cells, b] / new.loc[cells, a]).reindex(before.index).dropna()
        before = before.loc[after.index]
        total += len(after)
        closer += int(np.sum(np.abs(np.log(after.values)) <= np.abs(np.log(before.values)) + 1e-12))
        crossed = np.sign(before.values - 1.0) != np.sign(after.values - 1.0)
        flipped += [(cell, a, b, float(before[cell]), float(after[cell])) for cell in before.index[crossed]]
    return total, closer, flipped


def main(argv: list[str] | None = None) -> int:
    old_root, new_root, presets = parse_store_pair(__doc__.splitlines()[0], argv)
    pairs = closer_all = 0
    for preset in presets:
        total, closer, flipped = compare(step_times(old_root, preset), step_times(new_root, preset))
        pairs, closer_all = pairs + total, closer_all + closer
        print(f"{preset}: {total} pairs, {closer} as close to 1 or closer, {len(flipped)} changed side")
        for cell, a, b, before, after in flipped:
            print(f"  {cell} {b} / {a}: {before:.5f} -> {after:.5f}")
    print(f"all: {pairs} pairs, {closer_all} as close to 1 or closer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
