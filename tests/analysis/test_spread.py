"""Spread over trace seeds: ratios per seed, their mean and min-max, and ties where the range holds 1."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.render import to_markdown
from analysis.spread import is_tie, seeds
from analysis.tables import ablation, overall_cells, overall_summary, step_by_ep

# ReLibra's throughput over Megatron-LM per seed: cell "a" disagrees across seeds (a tie), "b" does not
RATIOS = {"a": (1.10, 0.95, 1.20), "b": (1.10, 1.20, 1.30)}


def _rows(ratios: dict[str, tuple[float, ...]]) -> pd.DataFrame:
    rows = []
    for model, per_seed in ratios.items():
        for seed, ratio in enumerate(per_seed):
            for planner, throughput in (("megatron", 100.0 + seed), ("relibra", (100.0 + seed) * ratio)):
                rows.append(
                    {
                        "model": model,
                        "dataset": "mixed",
                        "nodes": 4,
                        "gpus_per_node": 8,
                        "seed": seed,
                        "planner": planner,
                        "throughput_tokens_per_s": throughput,
                        "step_time_s": 1.0 / throughput,
                    }
                )
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    ("lo", "hi", "n", "tie"),
    [
        (0.95, 1.2, 3, True),
        (1.0, 1.2, 3, True),
        (1.01, 1.2, 3, False),
        (0.8, 0.99, 3, False),
        (0.9, 1.1, 1, False),
    ],
)
def test_a_ratio_is_a_tie_when_its_seeds_range_holds_1(lo: float, hi: float, n: int, tie: bool) -> None:
    assert is_tie(lo, hi, n) is tie


def test_overall_cells_give_each_ratios_mean_and_min_max_over_seeds() -> None:
    table = overall_cells(_rows(RATIOS))
    cells = table.frame.set_index("model")
    for model, per_seed in RATIOS.items():
        assert cells.loc[model, "over Megatron-LM"] == pytest.approx(sum(per_seed) / 3)
        assert cells.loc[model, "over Megatron-LM min"] == pytest.approx(min(per_seed))
        assert cells.loc[model, "over Megatron-LM max"] == pytest.approx(max(per_seed))
    shown = table.formatted().set_index("model")["over Megatron-LM"]
    assert shown["a"] == "1.08 (0.95-1.20) tie"
    assert shown["b"] == "1.20 (1.10-1.30)"
    assert "over Megatron-LM min" not in table.formatted().columns
    assert "3 seeds" in table.note and "min-max" in table.note


def test_overall_summary_counts_the_tied_cells() -> None:
    summary = overall_summary(_rows(RATIOS)).frame.set_index("against")
    assert summary.loc["over Megatron-LM", "cells tied"] == "1 of 2"
    assert summary.loc["over Megatron-LM", "ours lo"] == pytest.approx(sum(RATIOS["a"]) / 3)


def test_one_seed_shows_no_spread_and_says_so() -> None:
    one = _rows({"a": (1.10,), "b": (0.90,)})
    assert seeds(one) == 1
    table = overall_cells(one)
    assert list(table.formatted()["over Megatron-LM"]) == ["1.10", "0.90"]
    assert "One trace seed" in to_markdown(table)


def test_rows_without_a_seed_column_are_one_seed() -> None:
    frame = _rows({"a": (1.10,)}).drop(columns="seed")
    assert seeds(frame) == 1
    assert overall_cells(frame).frame["over Megatron-LM"].iloc[0] == pytest.approx(1.10)


def test_ablation_spreads_its_per_seed_geometric_mean() -> None:
    table = ablation(_rows(RATIOS))
    row = table.frame.set_index("variant").loc["ReLibra (paper)"]
    per_seed = [(a * b) ** 0.5 for a, b in zip(RATIOS["a"], RATIOS["b"], strict=True)]
    assert row["ours (x Megatron-LM)"] == pytest.approx(sum(per_seed) / 3)
    assert (row["min"], row["max"]) == (pytest.approx(min(per_seed)), pytest.approx(max(per_seed)))


def test_step_ratios_are_spread_and_tied_per_seed() -> None:
    frame = _rows({"a": (1.05, 0.97, 1.02)})  # Megatron-LM's step over ReLibra's is the throughput ratio
    shown = step_by_ep(frame).formatted()
    assert list(shown["Megatron-LM / ReLibra"]) == ["1.013 (0.970-1.050) tie"]


def test_the_fraction_of_balanced_has_no_ours_over_paper() -> None:
    rows = _rows(RATIOS)
    bound = rows[rows["planner"] == "megatron"].assign(planner="balanced", throughput_tokens_per_s=300.0)
    summary = overall_summary(pd.concat([rows, bound], ignore_index=True))
    row = summary.frame.set_index("against").loc["of Balanced"]
    assert row[["ours/paper lo", "ours/paper hi"]].isna().all() and row["paper lo"] == 0.90
    assert "not comparable" in summary.note
