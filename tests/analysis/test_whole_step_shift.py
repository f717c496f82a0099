"""The whole-step shift table (analysis/tables.py: whole_step_shift) on a hand-made results frame."""

from __future__ import annotations

import pandas as pd
import pytest

from analysis.tables import all_tables, whole_step_shift


def _frame() -> pd.DataFrame:
    thr = {
        ("moe", "relibra"): 130.0, ("moe", "megatron"): 100.0, ("moe", "eplb"): 125.0,
        ("moe", "ultraep"): 120.0, ("moe", "llep"): 110.0, ("moe", "force_balanced"): 140.0,
        ("whole", "relibra"): 80.0, ("whole", "megatron"): 70.0, ("whole", "eplb"): 78.0,
        ("whole", "ultraep"): 76.0, ("whole", "llep"): 72.0, ("whole", "force_balanced"): 84.0,
    }  # fmt: skip
    rows = [
        {"model": "m", "dataset": "d", "nodes": 2, "gpus_per_node": 8, "step": step, "planner": p,
         "throughput_tokens_per_s": v}
        for (step, p), v in thr.items()
    ]  # fmt: skip
    return pd.DataFrame(rows)


def test_each_ratio_on_both_steps_and_its_move() -> None:
    out = whole_step_shift(_frame()).frame
    row = out.iloc[0]
    assert row["EP"] == 16
    assert row["over Megatron-LM moe"] == pytest.approx(1.3)
    assert row["over Megatron-LM whole"] == pytest.approx(80 / 70)
    assert row["over Megatron-LM whole/moe"] == pytest.approx((80 / 70) / 1.3)
    assert row["% of force-balanced moe"] == pytest.approx(100 * 130 / 140)
    assert row["% of force-balanced whole"] == pytest.approx(100 * 80 / 84)
    assert out.iloc[-1]["model"] == "median"


def test_needs_both_steps() -> None:
    with pytest.raises(ValueError, match=r"both simulator\.step=moe and whole"):
        whole_step_shift(_frame().query("step == 'whole'"))
    tables, skipped = all_tables({"quick_whole_step_shift": _frame()})
    assert [t.name for t in tables] == ["quick_whole_step_shift.whole_step_shift"] and not skipped
