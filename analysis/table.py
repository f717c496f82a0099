"""A reproduced table: a display-ready frame, its formats, note and provenance, and its spreads over seeds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from analysis.spread import is_tie

__all__ = ["Table"]


@dataclass(frozen=True)
class Table:
    """One reproduced table: a display-ready frame plus how to format its float columns."""

    name: str
    """File stem (``<name>.md``, ``<name>.tex``)."""
    title: str
    frame: pd.DataFrame
    formats: Mapping[str, str] = field(default_factory=dict)
    """Column -> format spec (``".2f"``); float columns not named use ``".2f"``."""
    note: str = ""
    provenance: str = ""
    """Which code computed the cells and which command wrote the table (:mod:`analysis.provenance`)."""
    spread: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    """Column (a mean over trace seeds) -> its (min, max) columns over the seeds: shown as ``mean (min-max)``
    in one cell, the two columns hidden (:mod:`analysis.spread`)."""
    ties: frozenset[str] = frozenset()
    """Ratio columns of :attr:`spread` whose cells read ``tie`` where the seeds' range contains 1."""

    def formatted(self) -> pd.DataFrame:
        """The frame with every float rendered as text (NaN as an en dash), spreads beside their means."""
        hidden = {c for pair in self.spread.values() for c in pair}
        out = self.frame.drop(columns=[c for c in hidden if c in self.frame])
        for col in out.columns:
            if pd.api.types.is_float_dtype(out[col]):
                spec = self.formats.get(col, ".2f")
                text = [("–" if pd.isna(v) else format(v, spec)) for v in out[col]]
                if col in self.spread:
                    lo_col, hi_col = self.spread[col]
                    lows, highs = self.frame[lo_col].to_numpy(), self.frame[hi_col].to_numpy()
                    text = [
                        _with_spread(t, lo, hi, spec, col in self.ties)
                        for t, lo, hi in zip(text, lows, highs, strict=True)
                    ]
                out[col] = text
            else:
                out[col] = out[col].astype(str)
        return out


def _with_spread(text: str, lo: float, hi: float, spec: str, tie_mark: bool) -> str:
    """``mean (min-max)`` where the seeds differ, with ``tie`` where that range contains 1."""
    if pd.isna(lo) or pd.isna(hi) or lo == hi:
        return text
    out = f"{text} ({format(lo, spec)}-{format(hi, spec)})"
    return f"{out} tie" if tie_mark and is_tie(lo, hi, 2) else out
