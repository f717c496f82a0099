"""The recommended configuration's targets, judged on every committed cell (issue 28, "What it must reach").

One table over all experiments of a results root, so a reader sees in one place whether
``relibra_portfolio`` ("ReLibra (recommended)") meets what its configuration promises:

* **never slower** than Megatron-LM nor than ``relibra_replicate_only`` in any cell of any grid that runs
  them side by side (per grid: cells compared, cells lost, the worst throughput ratio and its cell);
* **reordering share** of the batch time (``t_reorder_s / step_time_s``), median and range over the
  paper-scale cells (grids without the ``quick_`` prefix), against the paper's upper end;
* goals reported, never tuned toward: ahead of UltraEP and LLEP in every ``overall`` cell, at least 90 % of
  force-balanced, skewness at or under 1.08.

A cell is one grid point with every setting but the planner equal: the columns of :data:`CELL_KEYS` present
in the results. A grid without both planners of a comparison is listed with ``cells = 0`` (not run), never
dropped, so a missing comparison cannot read as a met target.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from analysis import paper
from analysis.tables import CELL, Table

__all__ = ["CELL_KEYS", "RECOMMENDED", "recommended_targets"]

RECOMMENDED = "relibra_portfolio"
"""The planner whose targets the table judges."""

CELL_KEYS = (*CELL, "dispatcher", "ep_overlap", "step", "seed")
"""Columns naming one grid point (those present in a results frame); planners are compared within it."""

NEVER_SLOWER_THAN = ("megatron", "relibra_replicate_only")
"""The references the recommended configuration must never be slower than, in any cell."""

GOALS = {"ultraep": 1.0, "llep": 1.0, "force_balanced": 0.90}
"""Goal ratios (recommended throughput over the reference) reported per grid, not required."""

SKEW_GOAL = 1.08
"""Skewness (max over mean GPU tokens) the recommended configuration aims at, across EP 8-64."""


def _wide(frame: pd.DataFrame, value: str) -> pd.DataFrame:
    keys = [c for c in CELL_KEYS if c in frame.columns]
    return frame.groupby([*keys, "planner"], dropna=False)[value].mean().unstack("planner").reset_index()


def _cell_name(row: pd.Series) -> str:
    ep = int(row["nodes"] * row["gpus_per_node"])
    extra = [f"{k}={row[k]}" for k in ("dispatcher", "ep_overlap", "step") if k in row.index]
    return " ".join([str(row["model"]), str(row["dataset"]), f"EP {ep}", *extra])


def _compare(wide: pd.DataFrame, reference: str, bar: float) -> tuple[int, int, float, str]:
    """(cells compared, cells below ``bar``, worst throughput ratio, its cell); zeros when not run."""
    if RECOMMENDED not in wide or reference not in wide:
        return 0, 0, float("nan"), ""
    both = wide.dropna(subset=[RECOMMENDED, reference])
    if both.empty:
        return 0, 0, float("nan"), ""
    ratio = both[RECOMMENDED] / both[reference]
    worst = int(np.argmin(ratio.to_numpy()))
    return len(both), int((ratio < bar).sum()), float(ratio.iloc[worst]), _cell_name(both.iloc[worst])


def _share(rows: pd.DataFrame) -> pd.Series:
    """Reordering (migration) share of each row's batch time, in percent."""
    return 100.0 * rows["t_reorder_s"] / rows["step_time_s"]


def recommended_targets(by_experiment: Mapping[str, pd.DataFrame]) -> Table:
    """One row per grid (experiment) that ran the recommended configuration: per reference the cells
    compared, the cells below its bar and the worst ratio (with the cell for the required ones); the
    reordering share (median and range over the grid's cells) and the largest mean skewness. Raises
    ``ValueError`` when no grid ran it."""
    rows = []
    for experiment in sorted(by_experiment):
        frame = by_experiment[experiment]
        if RECOMMENDED not in set(frame["planner"]):
            continue
        wide = _wide(frame, "throughput_tokens_per_s")
        rec = frame[frame["planner"] == RECOMMENDED]
        share = _share(rec)
        row: dict[str, object] = {"grid": experiment, "cells": len(wide)}
        for reference in (*NEVER_SLOWER_THAN, *GOALS):
            bar = 1.0 if reference in NEVER_SLOWER_THAN else GOALS[reference]
            cells, below, worst, where = _compare(wide, reference, bar)
            name = paper.label(reference)
            row[f"below {name}"] = f"{below}/{cells}" if cells else "not run"
            row[f"worst over {name}"] = worst
            if reference in NEVER_SLOWER_THAN:
                row[f"worst cell ({name})"] = where
        row["reorder % median"] = float(share.median())
        row["reorder % range"] = f"{share.min():.2f}-{share.max():.2f}"
        row["skew max"] = float(rec["skew_mean"].max()) if "skew_mean" in rec else float("nan")
        rows.append(row)
    if not rows:
        raise ValueError(f"no grid ran planner={RECOMMENDED}")
    paper_scale = [
        by_experiment[e][by_experiment[e]["planner"] == RECOMMENDED]
        for e in sorted(by_experiment)
        if not e.startswith("quick_")
    ]
    pooled = pd.concat(paper_scale) if paper_scale else pd.DataFrame()
    lo, hi = paper.REORDER_OVERHEAD_PCT
    if len(pooled):
        share = _share(pooled)
        median = f"{share.median():.2f} % (cells {share.min():.2f}-{share.max():.2f} %, {len(share)} cells)"
    else:
        median = "no paper-scale cell"
    required = " and ".join(paper.label(r) for r in NEVER_SLOWER_THAN)
    goals = ", ".join(f"{paper.label(r)} >= {b:.2f}" for r, b in GOALS.items())
    note = (
        f"Ratios: {paper.label(RECOMMENDED)}'s throughput over the reference's, per cell (every setting but "
        f"the planner equal); 'below': cells under the bar / cells compared. Required: never below 1.00 "
        f"against {required}. Goals (reported, not tuned toward): {goals}; skewness <= {SKEW_GOAL}. "
        f"Reordering share of the batch time over every paper-scale cell: median {median}; the paper's "
        f"{lo:.1f}-{hi:.1f} %, target median <= {hi:.1f} %."
    )
    formats = {c: ".3f" for r in (*NEVER_SLOWER_THAN, *GOALS) for c in (f"worst over {paper.label(r)}",)}
    return Table(
        "recommended_targets",
        f"{paper.label(RECOMMENDED)}: its targets on every grid",
        pd.DataFrame(rows),
        {**formats, "reorder % median": ".2f", "skew max": ".3f"},
        note,
    )
