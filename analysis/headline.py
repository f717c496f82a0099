"""The headline figure: every planner's training throughput over Megatron-LM's, per model and dataset.

Drawn from the ``overall`` preset (the paper's scale) when it has finished cells, else from
``quick_overall``. Methods are bars; the bounds (``balanced``, ``force_balanced``) are reference marks
over each group of bars (a black bar for Balanced, a grey one for force-balanced) so that an ideal that
no plan reaches does not dwarf the methods. Written as ``headline.png`` and ``headline.pdf`` beside the
tables (``results/analysis/``).
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
from analysis.figures import PLANNER_ORDER, relative_throughput, save

__all__ = ["BOUNDS", "HEADLINE_PRESETS", "headline_source", "plot_headline", "write_headline"]

BOUNDS = {"balanced": ("black", "-"), "force_balanced": ("0.45", "--")}
"""Reference planners drawn as marks, not bars: name -> (colour, line style)."""
HEADLINE_PRESETS = ("overall", "quick_overall")
"""Where the headline comes from, in order of preference."""


def headline_source(by_experiment: Mapping[str, pd.DataFrame]) -> str:
    """The preset the headline is drawn from: the first of :data:`HEADLINE_PRESETS` with results."""
    for preset in HEADLINE_PRESETS:
        frame = by_experiment.get(preset)
        if frame is not None and not frame.empty:
            return preset
    raise ValueError(f"the headline figure needs finished cells of one of {list(HEADLINE_PRESETS)}")


def plot_headline(frame: pd.DataFrame, title: str = "") -> Figure:
    """Throughput over Megatron-LM: one panel per model, a group of bars per dataset, bounds as marks."""
    data = relative_throughput(frame)
    methods = data[~data["planner"].isin(list(BOUNDS))]
    planners = [p for p in PLANNER_ORDER if p in set(methods["planner"])]
    planners += sorted(set(methods["planner"]) - set(planners))
    datasets = list(dict.fromkeys(data["dataset"]))
    models = list(dict.fromkeys(data["model"]))
    palette = sns.color_palette("colorblind", len(planners))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(planners))
    for ax, model in zip(axes[0], models):
        rows = data[data["model"] == model]
        for i, planner in enumerate(planners):
            values = rows[rows["planner"] == planner].set_index("dataset")["relative"]
            x = np.arange(len(datasets)) - 0.4 + (i + 0.5) * width
            heights = [values.get(d, np.nan) for d in datasets]
            ax.bar(x, heights, width, color=palette[i], label=paper.label(planner))
        for bound, (colour, style) in BOUNDS.items():
            values = rows[rows["planner"] == bound].set_index("dataset")["relative"]
            for j, dataset in enumerate(datasets):
                if dataset in values:
                    ax.hlines(values[dataset], j - 0.42, j + 0.42, colors=colour, linestyles=style, lw=1.6)
            if not values.empty:
                ax.plot([], [], color=colour, linestyle=style, label=paper.label(bound))
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
