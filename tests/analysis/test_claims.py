"""The paper_claims table: verdicts by the written rule, causes read from the step-time terms."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.claims import TOL, paper_claims

# (step s, comm s, migration s) per planner; the other terms are equal across planners
STEPS = {
    "megatron": (10.0, 6.0, 0.0),
    "eplb": (9.2, 5.2, 0.0),
    "relibra": (9.0, 4.7, 0.3),
    "balanced": (5.0, 1.0, 0.0),
}


def _overall(steps: dict[str, tuple[float, float, float]], seeds: int = 2) -> pd.DataFrame:
    rows = []
    for seed in range(seeds):
        for model in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
            for planner, (step, comm, reorder) in steps.items():
                rows.append(
                    {
                        "model": model,
                        "dataset": "mixed",
                        "nodes": 4,
                        "gpus_per_node": 8,
                        "seed": seed,
                        "planner": planner,
                        "step_time_s": step,
                        "throughput_tokens_per_s": 1e6 / step,
                        "t_compute_s": 3.0,
                        "t_comm_s": comm,
                        "t_attention_s": 1.0,
                        "t_critical_path_s": 0.0,
                        "t_sync_exposed_s": 0.0,
                        "t_reorder_s": reorder,
                    }
                )
    return pd.DataFrame(rows)


def test_a_range_claim_outside_the_paper_is_not_reproduced_and_its_cause_is_measured() -> None:
    claims = paper_claims({"overall": _overall(STEPS)}).frame.set_index("claim")
    row = claims.loc["ReLibra over Megatron-LM (x)"]  # 10 / 9 = 1.11 < 1.21 x 0.95
    assert row["ours"] == "1.11" and row["paper"] == "1.21-1.58" and row["verdict"] == "not reproduced"
    assert row["cause"] == "ReLibra (paper) - Megatron-LM: step -1.000 s; comm s -1.300, migration s +0.300"
    eplb = claims.loc["ReLibra over EPLB+ (x)"]  # 9.2 / 9 = 1.022 >= 1.06 x 0.95 = 1.007
    assert eplb["verdict"] == "reproduced" and eplb["cause"] == "–"
    assert claims.loc["ReLibra as a fraction of Balanced", "verdict"] == "not comparable"


def test_the_quick_preset_stands_in_for_a_missing_paper_scale_one() -> None:
    claims = paper_claims({"quick_overall": _overall(STEPS, seeds=1)}).frame
    assert set(claims["source"]) == {"quick_overall.overall"}


def test_a_single_number_claim_uses_the_tolerance() -> None:
    rows = []
    for seed, factor in enumerate((1.44, 1.50)):  # reasoning: paper 1.46; mean 1.47 is within TOL
        for planner, value in (("megatron", 100.0), ("relibra", 100.0 * factor)):
            rows.append(
                {
                    "model": "m",
                    "dataset": "reasoning",
                    "nodes": 1,
                    "gpus_per_node": 8,
                    "seed": seed,
                    "planner": planner,
                    "throughput_tokens_per_s": value,
                    "step_time_s": 1 / value,
                }
            )
    claims = paper_claims({"ablation": pd.DataFrame(rows)}).frame.set_index("claim")
    row = claims.loc["ablation: ReLibra (paper), reasoning (x Megatron-LM)"]
    assert (row["ours"], row["spread"], row["verdict"]) == ("1.47", "1.44-1.50", "reproduced")
    assert TOL == pytest.approx(0.05)


def test_no_claim_the_results_can_speak_to_is_named() -> None:
    with pytest.raises(ValueError, match="paper_claims needs"):
        paper_claims({"comm_sensitivity": _overall(STEPS)})
