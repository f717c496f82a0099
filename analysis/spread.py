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

__all__ = ["SEED", "is_tie", "per_seed", "seeds", "summarise", "with_seed"]

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
