"""The peer preset's table and figure (analysis.peer): step time over force-balanced per workload."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from analysis.figures import FIGURES, save
from analysis.peer import peer_ratios, peer_table, plot_peer, short_name
from analysis.tables import all_tables

STEP = {"megatron": 3.0, "eplb": 2.0, "relibra_portfolio": 1.5, "force_balanced": 1.0}
"""Step seconds per planner on workload W1 at EP 8 and seed 0; W0 halves them, EP 32 doubles them, seed 1
adds 10 % to megatron's."""


def frame() -> pd.DataFrame:
    rows = []
    for workload, scale in (("W0_balanced", 0.5), ("W1_hot_expert_set", 1.0)):
        for nodes in (1, 4):
            for seed in (0, 1):
                for planner, step in STEP.items():
                    bump = 1.1 if (planner == "megatron" and seed == 1) else 1.0
                    rows.append(
                        {
                            "model": "qwen3-30b-a3b",
                            "dataset": workload,
                            "planner": planner,
                            "nodes": nodes,
                            "gpus_per_node": 8,
                            "seed": seed,
                            "step_time_s": step * scale * (2.0 if nodes == 4 else 1.0) * bump,
                        }
                    )
    return pd.DataFrame(rows)


def test_ratios_are_over_force_balanced_per_model_ep_and_workload() -> None:
    ratios = peer_ratios(frame())
    assert "force_balanced" not in ratios.columns
    assert ratios.loc[("qwen3-30b-a3b", 32, "W0_balanced"), "eplb"] == pytest.approx(2.0)
    assert ratios.loc[("qwen3-30b-a3b", 8, "W1_hot_expert_set"), "megatron"] == pytest.approx(3.15)


def test_table_orders_planners_by_mean_ratio_and_spreads_over_seeds() -> None:
    table = peer_table(frame())
    ratio_columns = [c for c in table.frame.columns[4:] if not c.endswith(("min", "max"))]
    assert ratio_columns == ["ReLibra (recommended)", "EPLB+", "Megatron-LM"]
    row = table.frame[(table.frame["EP"] == 8) & (table.frame["workload"] == "W1_hot_expert_set")].iloc[0]
    assert row["force-balanced step s"] == pytest.approx(1.0)
    assert (row["Megatron-LM min"], row["Megatron-LM max"]) == pytest.approx((3.0, 3.3))
    assert "3.150 (3.000-3.300)" in table.formatted()["Megatron-LM"].tolist()


def test_without_force_balanced_the_table_says_why() -> None:
    data = frame()
    with pytest.raises(ValueError, match="relative to force-balanced"):
        peer_table(data[data["planner"] != "force_balanced"])


def test_the_peer_presets_get_their_table_and_figure(tmp_path: Path) -> None:
    tables, skipped = all_tables({"quick_peer": frame()})
    assert [t.name for t in tables] == ["quick_peer.peer"] and not skipped
    assert [name for name, _ in FIGURES["peer"]] == ["peer"]
    paths = save(plot_peer(frame()), tmp_path, "quick_peer.peer")
    assert all(p.stat().st_size > 0 for p in paths)


def test_a_replay_mismatch_is_a_row_of_its_own() -> None:
    """Cells of one workload at two replay mismatches are never averaged together: each is divided by
    force-balanced at its own mismatch and named with it."""
    exact = frame().assign(replay_mismatch=0.0)
    off = frame().assign(replay_mismatch=0.1)
    off.loc[off["planner"] == "relibra_portfolio", "step_time_s"] *= 2.0
    ratios = peer_ratios(pd.concat([exact, off], ignore_index=True))
    at = ("qwen3-30b-a3b", 8, "W1_hot_expert_set")
    assert ratios.loc[at, "relibra_portfolio"] == pytest.approx(1.5)
    assert ratios.loc[(*at[:2], "W1_hot_expert_set, mismatch 0.1"), "relibra_portfolio"] == pytest.approx(3.0)
    assert (
        short_name("W1_hot_expert_set, mismatch 0.1") == "W1 r0.1" and short_name("W1_hot_expert_set") == "W1"
    )
    # results written before the column existed are exact replay
    np_ratios = peer_ratios(frame())
    assert np_ratios.loc[at, "relibra_portfolio"] == pytest.approx(1.5)
