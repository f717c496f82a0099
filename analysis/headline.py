"""The headline figure: every planner's training throughput over Megatron-LM's, per model and dataset.

One row of panels per dispatcher: the paper's all-to-all (the ``overall`` preset) and DeepEP, which
production runs use (``overall_deepep``: the same grid under ``cluster.dispatcher=deepep``), both without
the EP overlap; at the quick scale (``quick_overall``, ``quick_overall_deepep``) when the paper-scale
``overall`` has no finished cells, never one scale beside the other. A row whose preset has no cells is left
out. Methods are bars; the bounds are marked over each group of bars: force-balanced, the ceiling a real
system reaches, as a grey dashed bar, and Balanced, an ideal no plan reaches, as its value written above the
group, so that it does not dwarf the methods. Over several trace seeds each bar carries its min-max whisker.
Written as ``headline.png`` and ``headline.pdf`` beside the tables (``results/analysis/``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # NOTE: figures are files; no display is assumed (CI, Slurm nodes)

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.artist import Artist
from matplotlib.figure import Figure
from matplotlib.typing import LineStyleType

from analysis import paper
from analysis.figures import PLANNER_ORDER, planner_colours, save
from analysis.spread import per_seed, summarise

__all__ = [
    "BOUNDS",
    "HEADLINE_PRESETS",
    "headline_source",
    "headline_sources",
    "plot_headline",
    "relative_spread",
    "write_headline",
]

BOUNDS: dict[str, tuple[str, LineStyleType]] = {"balanced": ("black", "-"), "force_balanced": ("0.45", "--")}
"""Reference planners drawn as marks, not bars: name -> (colour, line style)."""
ANNOTATED_BOUND = "balanced"
"""The ideal bound no plan reaches: written as its value above each group instead of drawn, so that it sets
neither the axis nor the reader's eye; force-balanced, the ceiling a real system reaches, is drawn."""
HEADLINE_PRESETS = ("overall", "quick_overall")
"""Where the all-to-all row comes from, in order of preference (its scale sets the other rows')."""
DISPATCHER_ROWS = {"alltoall": "", "deepep": "_deepep"}
"""Rows of the figure: dispatcher -> the suffix of its preset's name (``overall`` + suffix)."""


def headline_source(by_experiment: Mapping[str, pd.DataFrame]) -> str:
    """The preset the all-to-all row is drawn from: the first of :data:`HEADLINE_PRESETS` with results."""
    for preset in HEADLINE_PRESETS:
        frame = by_experiment.get(preset)
        if frame is not None and not frame.empty:
            return preset
    raise ValueError(f"the headline figure needs finished cells of one of {list(HEADLINE_PRESETS)}")


def headline_sources(by_experiment: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    """Dispatcher -> preset of each row drawn: the all-to-all row's (:func:`headline_source`), then the
    other dispatchers' presets of the same scale that have results."""
    base = headline_source(by_experiment)
    out = {}
    for dispatcher, suffix in DISPATCHER_ROWS.items():
        frame = by_experiment.get(base + suffix)
        if frame is not None and not frame.empty:
            out[dispatcher] = base + suffix
    return out


def relative_spread(frame: pd.DataFrame) -> pd.DataFrame:
    """Each planner's throughput over Megatron-LM's per (model, dataset, EP) cell: the ratio per trace seed,
    then its ``relative`` mean and ``low`` / ``high`` (min-max over seeds; equal to the mean for one seed)."""
    keys = ["model", "dataset", "nodes", "gpus_per_node"]
    wide = per_seed(frame, keys, "throughput_tokens_per_s")
    if "megatron" not in wide:
        raise ValueError("normalised throughput needs rows with planner == 'megatron' (the reference)")
    ratios = wide.div(wide["megatron"], axis=0).stack().rename("ratio")
    stats = summarise(ratios, [*keys, "planner"]).reset_index()
    return stats.rename(columns={"mean": "relative", "min": "low", "max": "high"})


def plot_headline(rows_by: pd.DataFrame | Mapping[str, pd.DataFrame], title: str = "") -> Figure:
    """Throughput over Megatron-LM: one row of panels per dispatcher of ``rows_by`` (dispatcher -> its
    cells; one frame: one row, untitled by dispatcher), one panel per model, a group of bars per dataset,
    force-balanced as a mark, Balanced written as its value (:data:`ANNOTATED_BOUND`).

    Over several trace seeds a bar is the mean ratio and its whisker the min-max over the seeds. Every row
    has the same planners, colours and y axis.
    """
    frames = {"": rows_by} if isinstance(rows_by, pd.DataFrame) else dict(rows_by)
    if not frames:
        raise ValueError("the headline figure needs at least one row of cells")
    stats = {name: relative_spread(frame) for name, frame in frames.items()}
    data = pd.concat(list(stats.values()), ignore_index=True)
    methods = data[~data["planner"].isin(list(BOUNDS))]
    planners = [p for p in PLANNER_ORDER if p in set(methods["planner"])]
    planners += sorted(set(methods["planner"]) - set(planners))
    datasets = list(dict.fromkeys(data["dataset"]))
    models = list(dict.fromkeys(data["model"]))
    colours = planner_colours(planners)
    palette = [colours[paper.label(p)] for p in planners]
    drawn = data[data["planner"] != ANNOTATED_BOUND]
    top = 1.18 * float(np.nanmax(drawn["high"].to_numpy()))  # NOTE: room for the written bound's value
    fig, axes = plt.subplots(
        len(frames), len(models), figsize=(4.2 * len(models), 3.6 * len(frames)), sharey=True, squeeze=False
    )
    width = 0.8 / max(1, len(planners))
    for axes_row, (name, row_data) in zip(axes, stats.items()):
        for ax, model in zip(axes_row, models):
            _panel(ax, row_data[row_data["model"] == model], planners, palette, datasets, width, top)
            ax.set_title(f"{model}, {name}" if name else model)
        axes_row[0].set_ylabel("throughput / Megatron-LM")
    handles: dict[str, Artist] = {}
    for ax in axes.flat:  # NOTE: one legend entry per label, whichever row drew it
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    bounds = [paper.label(b) for b in BOUNDS]
    labels = [lab for lab in handles if not any(lab.startswith(b) for b in bounds)]
    labels += [lab for lab in handles if lab not in labels]  # NOTE: methods first, then the bounds
    fig.legend([handles[lab] for lab in labels], labels, loc="upper center", ncol=6, frameon=False)
    if title:
        fig.suptitle(title, y=0.01, fontsize="small")
    n_rows = -(-len(labels) // 6)
    fig.tight_layout(rect=(0, 0.04 / len(frames), 1, 1.0 - 0.07 * n_rows / len(frames)))
    return fig


def _panel(
    ax: plt.Axes,
    rows: pd.DataFrame,
    planners: list[str],
    palette: list[tuple[float, float, float]],
    datasets: list[str],
    width: float,
    top: float,
) -> None:
    """One model's panel: a bar (and whisker) per planner and dataset, the bounds over each group."""
    for i, planner in enumerate(planners):
        values = rows[rows["planner"] == planner].set_index("dataset")
        if values.empty:
            continue
        x = np.arange(len(datasets)) - 0.4 + (i + 0.5) * width
        heights = np.array([values["relative"].get(d, np.nan) for d in datasets])
        low = np.array([values["low"].get(d, np.nan) for d in datasets])
        high = np.array([values["high"].get(d, np.nan) for d in datasets])
        spread = None if np.allclose(low, high, equal_nan=True) else [heights - low, high - heights]
        ax.bar(x, heights, width, color=palette[i], label=paper.label(planner))
        if spread is not None:
            ax.errorbar(x, heights, yerr=spread, fmt="none", ecolor="0.15", elinewidth=0.8, capsize=1.5)
    for bound, (colour, style) in BOUNDS.items():
        values = rows[rows["planner"] == bound].set_index("dataset")["relative"]
        if bound == ANNOTATED_BOUND:
            for j, dataset in enumerate(datasets):
                if dataset in values:
                    ax.text(j, top, f"{paper.label(bound)}\n{values[dataset]:.2f}x", ha="center",
                            va="top", fontsize="x-small", color=colour)  # fmt: skip
            if not values.empty:
                ax.plot([], [], color=colour, linestyle="none", marker="$x$",
                        label=f"{paper.label(bound)} (ideal bound, value written)")  # fmt: skip
            continue
        for j, dataset in enumerate(datasets):
            if dataset in values:
                ax.hlines(values[dataset], j - 0.42, j + 0.42, colors=colour, linestyles=style, lw=1.6)
        if not values.empty:
            ax.plot([], [], color=colour, linestyle=style, label=paper.label(bound))
    ax.set_ylim(0.0, top)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xticks(np.arange(len(datasets)), [d.replace("_", "\n") for d in datasets])
    ax.set_xlabel("")


def write_headline(by_experiment: Mapping[str, pd.DataFrame], out_dir: Path) -> list[Path]:
    """Draw the headline from :func:`headline_sources` into ``out_dir/headline.{png,pdf}``."""
    sources = headline_sources(by_experiment)
    sns.set_theme(style="whitegrid", context="paper")
    rows = {dispatcher: by_experiment[preset] for dispatcher, preset in sources.items()}
    title = "presets " + ", ".join(f"{preset} ({dispatcher})" for dispatcher, preset in sources.items())
    return save(plot_headline(rows, title=title), out_dir, "headline")
