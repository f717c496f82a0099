"""The headline figure: methods as bars over Megatron-LM, bounds as marks, from the paper-scale preset."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from matplotlib.collections import LineCollection

from analysis.headline import headline_source, headline_sources, plot_headline, write_headline


def _frame(throughput: dict[str, float]) -> pd.DataFrame:
    rows = [
        {
            "model": model,
            "dataset": dataset,
            "nodes": 4,
            "gpus_per_node": 8,
            "planner": planner,
            "throughput_tokens_per_s": value * (2.0 if model == "b" else 1.0),
        }
        for model in ("a", "b")
        for dataset in ("reasoning", "coding")
        for planner, value in throughput.items()
    ]
    return pd.DataFrame(rows)


PLANNERS = {"megatron": 100.0, "relibra": 130.0, "eplb": 110.0, "balanced": 160.0, "force_balanced": 150.0}


def test_methods_are_bars_normalised_to_megatron_and_bounds_are_marks() -> None:
    fig = plot_headline(_frame(PLANNERS))
    axes = fig.axes
    assert len(axes) == 2  # one panel per model
    for ax in axes:
        heights = sorted(round(p.get_height(), 6) for p in ax.patches)
        assert heights == [1.0, 1.0, 1.1, 1.1, 1.3, 1.3]  # 3 methods x 2 datasets, over Megatron-LM
        marks = [c for c in ax.collections if isinstance(c, LineCollection)]
        levels = sorted(round(float(seg[0][1]), 6) for c in marks for seg in c.get_segments())
        assert levels == [1.5, 1.5]  # force-balanced, once per dataset
        written = sorted(t.get_text() for t in ax.texts)
        assert written == ["Balanced\n1.60x", "Balanced\n1.60x"]  # the ideal bound: its value, not a mark
        assert ax.get_ylim()[1] == pytest.approx(1.18 * 1.5)  # set by what is drawn, not by Balanced


def test_the_paper_scale_preset_is_preferred(tmp_path: Path) -> None:
    quick, paper_scale = _frame(PLANNERS), _frame(PLANNERS)
    assert headline_source({"quick_overall": quick}) == "quick_overall"
    assert headline_source({"quick_overall": quick, "overall": paper_scale}) == "overall"
    with pytest.raises(ValueError, match="overall"):
        headline_source({"ablation": quick})
    paths = write_headline({"overall": paper_scale}, tmp_path)
    assert sorted(p.name for p in paths) == ["headline.pdf", "headline.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_both_relibra_variants_are_labelled() -> None:
    fig = plot_headline(_frame({**PLANNERS, "relibra_portfolio": 140.0}))
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "ReLibra (paper)" in labels and "ReLibra (recommended)" in labels
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert heights == [1.0, 1.0, 1.1, 1.1, 1.3, 1.3, 1.4, 1.4]


def test_over_several_seeds_bars_are_means_with_min_max_whiskers() -> None:
    frames = [
        _frame({**PLANNERS, "relibra": value}).assign(seed=seed) for seed, value in enumerate((120.0, 140.0))
    ]
    fig = plot_headline(pd.concat(frames, ignore_index=True))
    ax = fig.axes[0]
    heights = sorted(round(p.get_height(), 6) for p in ax.patches)
    assert heights == [1.0, 1.0, 1.1, 1.1, 1.3, 1.3]  # ReLibra's bar: the mean of 1.2 and 1.4
    whiskers = [c for c in ax.containers if type(c).__name__ == "ErrorbarContainer"]
    assert len(whiskers) == 1  # ReLibra's alone: the other planners agree across seeds
    segments = whiskers[0].lines[2][0].get_segments()
    assert sorted((round(s[0][1], 6), round(s[1][1], 6)) for s in segments) == [(1.2, 1.4), (1.2, 1.4)]


def test_one_row_per_dispatcher_of_the_same_scale(tmp_path: Path) -> None:
    alltoall = _frame(PLANNERS)
    deepep = _frame({**PLANNERS, "relibra": 90.0})  # ReLibra loses to Megatron-LM under DeepEP here
    by = {"overall": alltoall, "overall_deepep": deepep, "quick_overall_deepep": deepep}
    assert headline_sources(by) == {"alltoall": "overall", "deepep": "overall_deepep"}
    # NOTE: the quick DeepEP row is never drawn beside the paper-scale all-to-all one
    assert headline_sources({"overall": alltoall, "quick_overall_deepep": deepep}) == {"alltoall": "overall"}
    assert headline_sources({"quick_overall": alltoall, "quick_overall_deepep": deepep}) == {
        "alltoall": "quick_overall",
        "deepep": "quick_overall_deepep",
    }
    fig = plot_headline({"alltoall": alltoall, "deepep": deepep})
    assert len(fig.axes) == 4  # 2 dispatchers x 2 models
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["a, alltoall", "b, alltoall", "a, deepep", "b, deepep"]
    low_row = sorted(round(p.get_height(), 6) for p in fig.axes[2].patches)
    assert low_row == [0.9, 0.9, 1.0, 1.0, 1.1, 1.1]  # the losing cell is drawn below 1, not left out
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert len(labels) == len(set(labels)) == 5  # one entry per planner and bound, not one per row
    assert set(labels[-2:]) == {"Balanced (ideal bound, value written)", "force-balanced"}  # bounds last
    paths = write_headline(by, tmp_path)
    assert all(p.stat().st_size > 0 for p in paths)


def test_every_planner_keeps_one_colour_distinct_from_the_others() -> None:
    """Each listed planner has its own colour (no two closer than 0.1 in RGB), the same whichever other
    planners a figure draws; a planner the list lacks still gets one."""
    import itertools

    import numpy as np

    from analysis import paper
    from analysis.figures import PLANNER_COLOURS, PLANNER_ORDER, planner_colours

    assert set(PLANNER_ORDER) <= set(PLANNER_COLOURS)
    colours = planner_colours(PLANNER_ORDER)
    assert len(colours) == len(PLANNER_ORDER)
    for (a, ca), (b, cb) in itertools.combinations(colours.items(), 2):
        assert np.linalg.norm(np.subtract(ca, cb)) > 0.1, (a, b)
    some = planner_colours(["foremoe", "megatron", "not_a_planner"])
    assert some[paper.label("foremoe")] == colours[paper.label("foremoe")]
    assert some[paper.label("megatron")] == colours[paper.label("megatron")]
    assert len(some) == 3


def test_the_headline_draws_each_planner_in_its_colour() -> None:
    from matplotlib.colors import to_rgb

    from analysis import paper
    from analysis.figures import planner_colours

    fig = plot_headline(_frame({"megatron": 1.0, "relibra": 1.3, "relibra_portfolio": 1.4, "foremoe": 1.2}))
    colours = planner_colours(["megatron", "relibra", "relibra_portfolio", "foremoe"])
    found = {c.get_label(): to_rgb(c.patches[0].get_facecolor()) for c in fig.axes[0].containers}
    for planner in ("megatron", "relibra", "relibra_portfolio", "foremoe"):
        assert found[paper.label(planner)] == pytest.approx(colours[paper.label(planner)])
