"""The recommended configuration's target table (analysis/targets.py) on hand-made results frames."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.targets import recommended_targets


def _rows(grid_cells: dict[tuple[str, int], dict[str, float]]) -> pd.DataFrame:
    """One row per (dataset, nodes) cell and planner: throughput, its step, migration 1 % of the step."""
    rows = []
    for (dataset, nodes), by_planner in grid_cells.items():
        for planner, thr in by_planner.items():
            step = 1000.0 / thr
            rows.append(
                {"model": "m", "dataset": dataset, "nodes": nodes, "gpus_per_node": 8, "nvl_domain": 8,
                 "planner": planner, "throughput_tokens_per_s": thr, "step_time_s": step,
                 "t_reorder_s": 0.01 * step if planner == "relibra_portfolio" else 0.0,
                 "skew_mean": 1.05 if planner == "relibra_portfolio" else 1.5}
            )  # fmt: skip
    return pd.DataFrame(rows)


def test_a_cell_slower_than_megatron_is_counted_and_named() -> None:
    frame = _rows(
        {
            ("a", 1): {"megatron": 100.0, "relibra_replicate_only": 110.0, "relibra_portfolio": 120.0},
            ("b", 2): {"megatron": 100.0, "relibra_replicate_only": 90.0, "relibra_portfolio": 95.0},
        }
    )
    row = recommended_targets({"overall": frame}).frame.iloc[0]
    assert row["below Megatron-LM"] == "1/2"
    assert row["worst over Megatron-LM"] == pytest.approx(0.95)
    assert row["worst cell (Megatron-LM)"].startswith("m b EP 16")
    assert row["below + intra-batch replication only"] == "0/2"
    assert row["worst over + intra-batch replication only"] == pytest.approx(95.0 / 90.0)
    assert row["reorder % median"] == pytest.approx(1.0)


def test_a_comparison_a_grid_did_not_run_reads_not_run() -> None:
    frame = _rows({("a", 1): {"megatron": 100.0, "relibra_portfolio": 120.0}})
    row = recommended_targets({"quick_ablation": frame}).frame.iloc[0]
    assert row["below + intra-batch replication only"] == "not run"
    assert pd.isna(row["worst over + intra-batch replication only"])
    assert row["below Megatron-LM"] == "0/1"


def test_no_grid_with_the_recommended_configuration_is_an_error() -> None:
    frame = _rows({("a", 1): {"megatron": 100.0, "relibra": 120.0}})
    with pytest.raises(ValueError, match="relibra_portfolio"):
        recommended_targets({"overall": frame})


def test_the_paper_scale_median_leaves_out_quick_grids() -> None:
    quick = _rows({("a", 1): {"megatron": 100.0, "relibra_portfolio": 120.0}})
    quick.loc[quick.planner == "relibra_portfolio", "t_reorder_s"] *= 50.0
    paper = _rows({("a", 1): {"megatron": 100.0, "relibra_portfolio": 120.0}})
    note = recommended_targets({"quick_overall": quick, "overall": paper}).note
    assert "median 1.00 %" in note
