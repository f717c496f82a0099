"""The paper's figures as seaborn plots (PNG and PDF), from the frames ``analysis.load`` returns.

Each ``plot_*`` function takes a results (or per-layer) frame and returns a matplotlib ``Figure``;
``save`` writes it as ``<name>.png`` and ``<name>.pdf``. Paper numbers are drawn where the paper gives them
(black diamonds for point values, a grey band for ranges).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # NOTE: figures are files; no display is assumed (CI, Slurm nodes)

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

from analysis import paper
from analysis.peer import plot_peer
from analysis.tables import BREAKDOWN, ONLINE_BASELINES, REPLAY_PLANNERS, ep_size
from relibra.planners import registry

__all__ = [
    "FIGURES",
    "PER_LAYER_SKEW",
    "all_figures",
    "plot_ablation",
    "plot_layer_skew",
    "plot_skew_by_ep",
    "plot_step_breakdown",
    "plot_throughput",
    "relative_throughput",
    "save",
]

PER_LAYER_SKEW = "skew"
"""Column of the per-layer table holding skewness of one (planner, microbatch, layer)."""

PLANNER_ORDER = registry.figure_order()
"""The order planners are drawn in (:func:`relibra.planners.registry.figure_order`)."""

PLANNER_COLOURS: dict[str, tuple[str, int]] = registry.colours()
"""Each planner's colour in every figure, as (seaborn palette, index), from its planner card
(:mod:`relibra.planners.registry`): one colour per planner wherever it is drawn."""


def planner_colours(planners: list[str]) -> dict[str, tuple[float, float, float]]:
    """Colour of each planner's label (:func:`analysis.paper.label`): :data:`PLANNER_COLOURS`, distinct
    ``husl`` hues for planners it does not list."""
    unknown = [p for p in planners if p not in PLANNER_COLOURS]
    extra = dict(zip(unknown, sns.color_palette("husl", len(unknown)), strict=True))
    out = {}
    for p in planners:
        if p in extra:
            out[paper.label(p)] = extra[p]
        else:
            name, index = PLANNER_COLOURS[p]
            out[paper.label(p)] = sns.color_palette(name)[index]
    return out


def _palette(present: pd.Series) -> dict[str, tuple[float, float, float]]:
    return planner_colours(list(dict.fromkeys(present)))


def _order(present: pd.Series) -> list[str]:
    names = set(present.unique())
    return [paper.label(p) for p in PLANNER_ORDER if p in names] + sorted(
        paper.label(p) for p in names - set(PLANNER_ORDER)
    )


def relative_throughput(frame: pd.DataFrame) -> pd.DataFrame:
    """Throughput of every row over Megatron-LM's in the same (model, dataset, EP) cell."""
    keys = ["model", "dataset", "nodes", "gpus_per_node"]
    data = frame.groupby([*keys, "planner"], as_index=False)["throughput_tokens_per_s"].mean()
    ref = data[data["planner"] == "megatron"].set_index(keys)["throughput_tokens_per_s"]
    if ref.empty:
        raise ValueError("normalised throughput needs rows with planner == 'megatron' (the reference)")
    data["relative"] = (
        data["throughput_tokens_per_s"] / ref.reindex(pd.MultiIndex.from_frame(data[keys])).to_numpy()
    )
    data["planner_label"] = data["planner"].map(paper.label)
    return data


def plot_throughput(frame: pd.DataFrame) -> Figure:
    """Normalised throughput (x Megatron-LM) per dataset, one panel per model, one bar per planner."""
    data = relative_throughput(frame)
    grid = sns.catplot(
        data=data,
        kind="bar",
        x="dataset",
        y="relative",
        hue="planner_label",
        hue_order=_order(data["planner"]),
        col="model",
        col_wrap=min(3, data["model"].nunique()),
        height=3.2,
        aspect=1.3,
        palette=_palette(data["planner"]),
        legend_out=True,
    )
    grid.set_axis_labels("dataset", "throughput / Megatron-LM")
    grid.set_titles("{col_name}")
    for ax in grid.axes.flat:
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.tick_params(axis="x", rotation=20)
    if grid.legend is not None:
        grid.legend.set_title("planner")
    grid.figure.suptitle("Training throughput normalised to Megatron-LM", y=1.03)
    return grid.figure


def plot_ablation(frame: pd.DataFrame) -> Figure:
    """Ablation bars: throughput relative to Megatron-LM per dataset, with the paper's values as diamonds."""
    data = relative_throughput(frame)
    data = data.groupby(["dataset", "planner", "planner_label"], as_index=False)["relative"].mean()
    order = _order(data["planner"])
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    sns.barplot(
        data=data,
        x="dataset",
        y="relative",
        hue="planner_label",
        hue_order=order,
        ax=ax,
        palette=_palette(data["planner"]),
    )
    datasets = list(dict.fromkeys(data["dataset"]))
    width = 0.8 / len(order)
    shown = False
    for (planner, dataset), value in paper.ABLATION.items():
        if dataset in datasets and paper.label(planner) in order:
            x = datasets.index(dataset) - 0.4 + width * (order.index(paper.label(planner)) + 0.5)
            ax.plot(x, value, "D", color="black", markersize=6, label=None if shown else "paper")
            shown = True
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_ylabel("throughput / Megatron-LM")
    ax.set_title("Ablation (mean over models)")
    ax.legend(title=None, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_skew_by_ep(frame: pd.DataFrame) -> Figure:
    """Mean skewness against EP size per planner; the paper's ReLibra range as a grey band."""
    data = frame.assign(EP=ep_size(frame), planner_label=frame["planner"].map(paper.label))
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    lo, hi = paper.SKEW_BY_EP["relibra"]
    ax.axhspan(lo, hi, color="grey", alpha=0.25, label=f"paper ReLibra {lo:.2f}-{hi:.2f}")
    sns.lineplot(
        data=data,
        x="EP",
        y="skew_mean",
        hue="planner_label",
        hue_order=_order(data["planner"]),
        marker="o",
        ax=ax,
        palette=_palette(data["planner"]),
        errorbar=None,
    )
    ax.set_xscale("log", base=2)
    eps = sorted(data["EP"].unique())
    ax.set_xticks(eps, [str(e) for e in eps])
    ax.set_xlabel("EP size (GPUs)")
    ax.set_ylabel("skewness (max / mean GPU tokens)")
    ax.set_title(f"Skewness vs EP size ({', '.join(sorted(data['model'].unique()))})")
    ax.legend(fontsize=8, title=None)
    fig.tight_layout()
    return fig


def plot_layer_skew(layers: pd.DataFrame, planners: tuple[str, ...] = ("megatron", "relibra")) -> Figure:
    """Per-layer skewness over micro-batches (heatmap: layer x micro-batch), one panel per planner.

    ``layers`` needs columns ``planner``, ``micro_batch``, ``layer`` and ``skew``; when it holds several
    cells, the first (model, dataset) present for every planner is drawn.
    """
    present = [p for p in planners if p in set(layers["planner"])]
    if not present:
        raise ValueError(f"per-layer table has none of the planners {planners}")
    if "model" in layers:
        first = layers[layers["planner"] == present[0]][["model", "dataset"]].iloc[0]
        layers = layers[(layers["model"] == first["model"]) & (layers["dataset"] == first["dataset"])]
        where = f"{first['model']}, {first['dataset']}"
    else:
        where = ""
    vmax = float(np.nanpercentile(layers[PER_LAYER_SKEW], 99))
    fig, axes = plt.subplots(1, len(present), figsize=(5.0 * len(present), 4.2), sharey=True, squeeze=False)
    for i, (ax, planner) in enumerate(zip(axes[0], present)):
        grid = (
            layers[layers["planner"] == planner]
            .groupby(["layer", "micro_batch"])[PER_LAYER_SKEW]
            .mean()
            .unstack("micro_batch")
        )
        last = i == len(present) - 1
        sns.heatmap(
            grid,
            ax=ax,
            vmin=1.0,
            vmax=max(vmax, 1.01),
            cmap="rocket_r",
            cbar=last,
            cbar_kws={"label": "skewness"} if last else None,
        )
        if "batch" in layers:  # white lines between RL steps (a reordering happens at each)
            steps = layers[layers["planner"] == planner].groupby("micro_batch")["batch"].first()
            for x in np.flatnonzero(np.diff(steps.to_numpy())) + 1:
                ax.axvline(x, color="white", linewidth=2)
        ax.set_title(f"{paper.label(planner)} (mean {np.nanmean(grid.to_numpy()):.2f})")
        ax.set_xlabel("micro-batch (white line: next RL step)" if "batch" in layers else "micro-batch")
        ax.set_ylabel("MoE layer")
    fig.suptitle(f"Per-layer skewness over micro-batches ({where})" if where else "Per-layer skewness")
    fig.tight_layout()
    return fig


def plot_step_breakdown(frame: pd.DataFrame) -> Figure:
    """What routing replay adds: each planner's mean step time stacked by its terms (compute, communication,
    attention, planning on the critical path, replica refill, migration), one panel per (model, EP size)."""
    data = frame[frame["planner"].isin(REPLAY_PLANNERS)].assign(EP=ep_size(frame))
    if not set(data["planner"]) & set(ONLINE_BASELINES):
        raise ValueError(f"the step breakdown needs rows of one of {list(ONLINE_BASELINES)}")
    terms = [c for c in BREAKDOWN.values() if c in data]
    means = data.groupby(["model", "EP", "planner"])[terms].mean().fillna(0.0)
    panels = list(dict.fromkeys((m, ep) for m, ep, _ in means.index))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.6), squeeze=False, sharey=False)
    colors = sns.color_palette("colorblind", len(terms))
    for ax, (model, ep) in zip(axes[0], panels):
        part = means.loc[(model, ep)]
        part = part.loc[[p for p in REPLAY_PLANNERS if p in part.index]]
        bottom = np.zeros(len(part))
        for color, (label, col) in zip(colors, [(k, v) for k, v in BREAKDOWN.items() if v in terms]):
            ax.bar(range(len(part)), part[col], bottom=bottom, color=color, label=label)
            bottom += part[col].to_numpy()
        ax.set_xticks(range(len(part)), [paper.label(p) for p in part.index], rotation=35, ha="right")
        ax.set_title(f"{model}, EP {ep}", fontsize=9)
        ax.set_ylabel("step time (s)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("What routing replay adds: step time by term")
    fig.tight_layout()
    return fig


def save(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    """Write ``fig`` as ``<name>.png`` (150 dpi) and ``<name>.pdf``; closes it; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)
    return paths


FIGURES: dict[str, list[tuple[str, Callable[[pd.DataFrame], Figure]]]] = {
    "overall": [("throughput", plot_throughput), ("step_breakdown", plot_step_breakdown)],
    "ablation": [("ablation", plot_ablation)],
    "ep_scaling": [("skew_by_ep", plot_skew_by_ep), ("step_breakdown", plot_step_breakdown)],
    "datasets": [("step_breakdown", plot_step_breakdown)],
    "real_trace": [("throughput", plot_throughput)],
    "peer": [("peer", plot_peer)],
}
"""Preset kind -> the figures drawn from its results frame."""
LAYER_FIGURES = ("overall", "datasets", "real_trace")
"""Preset kinds whose per-layer tables give a skewness heatmap."""


def all_figures(
    by_experiment: Mapping[str, pd.DataFrame],
    per_layer: Mapping[str, pd.DataFrame],
    out_dir: Path,
) -> tuple[list[Path], list[str]]:
    """Draw every figure the present experiments allow as ``<experiment>.<figure>.{png,pdf}``.

    Returns the written paths and why any figure was skipped.
    """
    sns.set_theme(style="whitegrid", context="paper")
    jobs: list[tuple[str, str, Callable[[pd.DataFrame], Figure], pd.DataFrame]] = []
    for experiment, frame in by_experiment.items():
        for name, plot in FIGURES.get(experiment.removeprefix("quick_"), []):
            jobs.append((experiment, name, plot, frame))
    for experiment, layers in per_layer.items():
        if experiment.removeprefix("quick_") in LAYER_FIGURES:
            jobs.append((experiment, "layer_skew", plot_layer_skew, layers))
    written: list[Path] = []
    skipped: list[str] = []
    for experiment, name, draw, frame in jobs:
        try:
            fig = draw(frame)
        except (ValueError, KeyError) as exc:  # NOTE: a partial grid must not cost the other figures
            skipped.append(f"{experiment}: figure {name} skipped: {exc}")
            plt.close("all")
            continue
        written += save(fig, out_dir, f"{experiment}.{name}")
    return written, skipped
