"""The headline figure: every planner's training throughput over Megatron-LM's, per model and dataset.

Drawn from the ``overall`` preset (the paper's scale) when it has finished cells, else from
``quick_overall``. Methods are bars; the bounds are marked over each group of bars: force-balanced, the
ceiling a real system reaches, as a grey dashed bar, and Balanced, an ideal no plan reaches, as its value
written above the group, so that it does not dwarf the methods. Over several trace seeds each bar carries
its min-max whisker. Written as ``headline.png`` and ``headline.pdf`` beside the tables
(``results/analysis/``).
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
from matplotlib.figure import Figure

from analysis import paper
from analysis.figures import PLANNER_ORDER, save
from analysis.spread import per_seed, summarise

__all__ = [
    "BOUNDS",
    "HEADLINE_PRESETS",
    "headline_source",
    "plot_headline",
    "relative_spread",
    "write_headline",
]

BOUNDS = {"balanced": ("black", "-"), "force_balanced": ("0.45", "--")}
"""Reference planners drawn as marks, not bars: name -> (colour, line style)."""
ANNOTATED_BOUND = "balanced"
"""The ideal bound no plan reaches: written as its value above each group instead of drawn, so that it sets
neither the axis nor the reader's eye; force-balanced, the ceiling a real system reaches, is drawn."""
HEADLINE_PRESETS = ("overall", "quick_overall")
"""Where the headline comes from, in order of preference."""


def headline_source(by_experiment: Mapping[str, pd.DataFrame]) -> str:
    """The preset the headline is drawn from: the first of :data:`HEADLINE_PRESETS` with results."""
    for preset in HEADLINE_PRESETS:
        frame = by_experiment.get(preset)
        if frame is not None and not frame.empty:
            return preset
    raise ValueError(f"the headline figure needs finished cells of one of {list(HEADLINE_PRESETS)}")


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


def plot_headline(frame: pd.DataFrame, title: str = "") -> Figure:
    """Throughput over Megatron-LM: one panel per model, a group of bars per dataset, force-balanced as a
    mark, Balanced written as its value (:data:`ANNOTATED_BOUND`).

    Over several trace seeds a bar is the mean ratio and its whisker the min-max over the seeds.
    """
    data = relative_spread(frame)
    methods = data[~data["planner"].isin(list(BOUNDS))]
    planners = [p for p in PLANNER_ORDER if p in set(methods["planner"])]
    planners += sorted(set(methods["planner"]) - set(planners))
    datasets = list(dict.fromkeys(data["dataset"]))
    models = list(dict.fromkeys(data["model"]))
    # NOTE: "colorblind" has 10 colours and repeats after them; more planners get distinct "husl" hues
    palette = sns.color_palette("colorblind" if len(planners) <= 10 else "husl", len(planners))
    drawn = data[data["planner"] != ANNOTATED_BOUND]
    top = 1.18 * float(np.nanmax(drawn["high"].to_numpy()))  # NOTE: room for the written bound's value
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(planners))
    for ax, model in zip(axes[0], models):
        rows = data[data["model"] == model]
        for i, planner in enumerate(planners):
            values = rows[rows["planner"] == planner].set_index("dataset")
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
        ax.set_title(model)
        ax.set_xlabel("")
    axes[0][0].set_ylabel("throughput / Megatron-LM")
    handles, labels = axes[0][0].get_legend_handles_labels()
    n_bounds = sum(1 for b in BOUNDS if b in set(data["planner"]))
    order = [*range(n_bounds, len(labels)), *range(n_bounds)]  # NOTE: methods first, then the bounds
    fig.legend(
        [handles[i] for i in order], [labels[i] for i in order], loc="upper center", ncol=6, frameon=False
    )
    if title:
        fig.suptitle(title, y=0.02, fontsize="small")
    rows = -(-len(labels) // 6)
    fig.tight_layout(rect=(0, 0.04, 1, 1.0 - 0.07 * rows))
    return fig


def write_headline(by_experiment: Mapping[str, pd.DataFrame], out_dir: Path) -> list[Path]:
    """Draw the headline from :func:`headline_source` into ``out_dir/headline.{png,pdf}``."""
    preset = headline_source(by_experiment)
    sns.set_theme(style="whitegrid", context="paper")
    return save(plot_headline(by_experiment[preset], title=f"preset {preset}"), out_dir, "headline")
