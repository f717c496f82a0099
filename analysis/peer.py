"""The peer preset's table and figure: each planner's step time over force-balanced on Megatron-LM's
token-imbalance workloads W0-W7 (docs/workloads.md), per model and EP size.

Force-balanced routes every micro-batch's tokens evenly over the GPUs at no cost: a ratio of 1.00 is a
planner that removes all the imbalance a workload puts in; Megatron-LM's ratio is what the workload costs
without balancing.

A cell whose trained routes differ from the replayed ones (results column ``replay_mismatch`` > 0, routing
replay off or partial: relibra/trace/mismatch.py) is its own row, the workload named with its mismatch
(``W6_rotating_hotspot, mismatch 0.1``), divided by force-balanced at the same mismatch (force-balanced
itself routes uniformly whatever the replay). Results without the column are exact replay.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # NOTE: figures are files; no display is assumed (CI, Slurm nodes)

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from analysis import paper
from analysis.spread import add_spread, per_seed, seed_note, summarise
from analysis.table import Table

__all__ = [
    "BOUND",
    "KEYS",
    "MISMATCH",
    "peer_ratios",
    "peer_table",
    "plot_peer",
    "short_name",
    "workload_name",
]

BOUND = "force_balanced"
"""The planner every step time is divided by."""
KEYS = ["model", "EP", "workload"]
"""A row of the table: the workload (the cells' ``dataset``, with its replay mismatch when above 0) at one
model and EP size."""
MISMATCH = "replay_mismatch"
"""The results column of the trained routes' re-drawn share (absent in results of exact replay)."""


def workload_name(dataset: str, mismatch: float) -> str:
    """The table's workload: ``dataset``, or ``"<dataset>, mismatch <m>"`` when ``mismatch`` > 0."""
    return str(dataset) if not mismatch else f"{dataset}, mismatch {mismatch:g}"


def short_name(workload: str) -> str:
    """A figure column: the workload id before its first ``_`` (``W6``), with ``r<m>`` for a mismatch."""
    name, _, mismatch = str(workload).partition(", mismatch ")
    return name.split("_")[0] + (f" r{mismatch}" if mismatch else "")


def _per_seed(frame: pd.DataFrame) -> pd.DataFrame:
    """Step time per (model, EP, workload, seed), one column per planner."""
    mismatch = frame[MISMATCH].fillna(0.0) if MISMATCH in frame.columns else pd.Series(0.0, index=frame.index)
    names = [workload_name(d, float(m)) for d, m in zip(frame["dataset"], mismatch, strict=True)]
    data = frame.assign(EP=(frame["nodes"] * frame["gpus_per_node"]).astype(int), workload=names)
    wide = per_seed(data, KEYS, "step_time_s").sort_index()
    if BOUND not in wide.columns:
        raise ValueError(f"no {BOUND} rows: the peer table is relative to force-balanced")
    return wide


def peer_ratios(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds of each planner's step time over force-balanced; index (model, EP, workload),
    one column per planner (force-balanced's own left out)."""
    wide = _per_seed(frame)
    ratios = wide.drop(columns=BOUND).div(wide[BOUND], axis=0)
    return ratios.groupby(level=KEYS).mean()


def peer_table(frame: pd.DataFrame) -> Table:
    """Step time over force-balanced per (model, EP, workload) and planner, beside force-balanced's own
    step time; Megatron-LM's column is what the workload costs without balancing."""
    wide = _per_seed(frame)
    order = peer_ratios(frame).mean().sort_values().index
    cols: dict[str, pd.Series] = {"force-balanced step s": summarise(wide[BOUND], KEYS)["mean"]}
    spread: dict[str, tuple[str, str]] = {}
    for planner in order:
        add_spread(cols, spread, paper.label(planner), wide[planner] / wide[BOUND], KEYS)
    out = pd.DataFrame(cols).rename_axis(KEYS).reset_index()
    note = (
        "Step time over force-balanced (tokens spread evenly at no cost) on Megatron-LM PR #7488's workloads "
        "(relibra.trace.peer, docs/workloads.md); planners ordered by their mean ratio. " + seed_note(frame)
    )
    return Table(
        "peer",
        "Step time over force-balanced by token-imbalance workload",
        out,
        {c: ".3f" for c in out.columns[len(KEYS) :]},
        note,
        spread=spread,
    )


def plot_peer(frame: pd.DataFrame) -> Figure:
    """Heatmaps of step time over force-balanced: a panel per (model, EP), planners down, workloads across."""
    ratios = peer_ratios(frame)
    order = ratios.mean().sort_values().index
    panels = sorted({(m, ep) for m, ep, _ in ratios.index})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(1.0 + 0.55 * 8 * len(panels), 0.42 * len(order) + 1.6), squeeze=False
    )
    top = float(np.nanmax(ratios.to_numpy()))
    for ax, (model, ep) in zip(axes[0], panels, strict=True):
        grid = ratios.xs((model, ep), level=["model", "EP"])[order].T
        grid.columns = [short_name(w) for w in grid.columns]
        grid.index = [paper.label(p) for p in grid.index]
        sns.heatmap(
            grid,
            ax=ax,
            annot=True,
            fmt=".2f",
            annot_kws={"size": 6},
            cmap="rocket_r",
            vmin=1.0,
            vmax=max(top, 1.01),
            cbar=ax is axes[0][-1],
        )
        ax.set_title(f"{model}, EP {ep}", fontsize=9)
        ax.set_xlabel("workload")
        ax.tick_params(labelsize=7)
    fig.suptitle("Step time over force-balanced, Megatron-LM token-imbalance workloads", fontsize=10)
    fig.tight_layout()
    return fig
