"""Spread over trace seeds: each ratio per seed, then its mean and its min-max over the seeds, and ties.

A paper-scale cell is run at several trace seeds (the ``seed`` result column; presets sweep ``seed``). A
ratio between two planners is taken within one seed (both planners saw the same routing), then summarised
over the seeds by its mean and its range (min-max over seeds, not a confidence interval: three seeds are
too few for one). A ratio whose range contains 1 is a *tie*: the seeds do not agree on which planner is
faster. Rows of one seed (the quick presets) have no spread and are never marked as ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

__all__ = ["SEED", "add_spread", "is_tie", "per_seed", "seed_note", "seeds", "summarise", "with_seed"]

SEED = "seed"
"""Result column of the trace seed (``experiments.run``); rows without it count as seed 0."""


def with_seed(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with a ``seed`` column (0 where the results predate it)."""
    if SEED in frame:
        return frame.assign(**{SEED: frame[SEED].fillna(0).astype(int)})
    return frame.assign(**{SEED: 0})


def seeds(frame: pd.DataFrame) -> int:
    """How many trace seeds the rows of ``frame`` hold."""
    return int(with_seed(frame)[SEED].nunique())


def per_seed(frame: pd.DataFrame, keys: Sequence[str], value: str) -> pd.DataFrame:
    """``value`` averaged per (``keys``, seed, planner), one column per planner; index: ``keys`` + seed."""
    data = with_seed(frame)
    present = [k for k in keys if k in data.columns]
    means = data.groupby([*present, SEED, "planner"], dropna=False)[value].mean()
    return means.unstack("planner")


def summarise(values: pd.Series, keys: Sequence[str]) -> pd.DataFrame:
    """Per-seed ``values`` (indexed by ``keys`` + seed) -> ``mean``, ``min``, ``max``, ``seeds`` per ``keys``
    (NaN seeds left out)."""
    grouped = values.dropna().groupby(level=list(keys), dropna=False)
    return grouped.agg(["mean", "min", "max", "count"]).rename(columns={"count": "seeds"})


def is_tie(lo: float, hi: float, n: int) -> bool:
    """Whether a ratio whose seeds range over ``[lo, hi]`` (``n`` seeds) is a tie: more than one seed, and
    the range contains 1."""
    return bool(n > 1 and not np.isnan(lo) and not np.isnan(hi) and lo <= 1.0 <= hi)


def seed_note(frame: pd.DataFrame) -> str:
    """What a table's spreads are: over how many trace seeds, min-max, and the tie rule."""
    n = seeds(frame)
    if n <= 1:
        return "One trace seed per cell: no spread over seeds (the paper-scale presets run three)."
    return (
        f"Each ratio is taken per trace seed ({n} seeds) and shown as its mean (min-max over the seeds); "
        "'tie': that range contains 1, so the seeds do not agree on which planner is faster."
    )


def add_spread(
    cols: dict[str, pd.Series], spread: dict[str, tuple[str, str]], name: str, per_seed_values: pd.Series,
    keys: list[str], scale: float = 1.0,
) -> None:  # fmt: skip
    """Mean, min and max over seeds of ``per_seed_values`` (times ``scale``) as columns ``name``,
    ``name min``, ``name max``."""
    stats = summarise(per_seed_values * scale, keys)
    cols[name], cols[f"{name} min"], cols[f"{name} max"] = stats["mean"], stats["min"], stats["max"]
    spread[name] = (f"{name} min", f"{name} max")
