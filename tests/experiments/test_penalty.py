"""The imbalance-penalty check (experiments/validation/penalty.py, ``validate --penalty``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from experiments.config.errors import ConfigError
from experiments.validation.cli import main as validate_main
from experiments.validation.penalty import (
    SHARED,
    implied_std,
    load_penalty_rows,
    measured_penalty,
    penalty_table,
    simulate_pair,
)

SMALL = {
    "id": "olmoe/8gpu/tp2/small",
    "role": "check",
    "config": {
        "gpus": 8,
        "ep": 8,
        "tp": 2,
        "pp": 1,
        "cp": 1,
        "micro_batch": 1,
        "global_batch": 16,
        "seq_len": 512,
    },
    "forced_tflops_per_gpu": 102.0,
    "dropless_tflops_per_gpu": 100.0,
    "overrides": [
        "model=olmoe-1b-7b",
        "cluster=hopper",
        "cluster.nodes=1",
        "cluster.gpus_per_node=8",
        "parallel.tp=2",
    ],
}


def test_rows_are_checks_with_the_published_penalty() -> None:
    rows = load_penalty_rows()["rows"]
    assert [r["role"] for r in rows] == ["check"] * 4
    assert measured_penalty(rows[0]) == pytest.approx(295 / 237 - 1)
    assert measured_penalty(rows[1]) == pytest.approx(335 / 277 - 1)
    # every row is simulated, the 64K / 128K ones with a TP x CP group over 2 / 4 EP groups
    assert [bool(r.get("needs")) for r in rows] == [False] * 4


def test_forced_is_balanced_and_the_penalty_grows_with_the_bias() -> None:
    mild = simulate_pair(SMALL, "force_biased:0.25")
    strong = simulate_pair(SMALL, "force_biased:1.0")
    assert mild["forced_skew"] < 1.1 and mild["forced_step_s"] == strong["forced_step_s"]
    assert 0 < mild["penalty"] < strong["penalty"]
    assert mild["dropless_skew"] < strong["dropless_skew"]
    assert strong["measured_penalty"] == pytest.approx(0.02)


def test_the_published_values_are_never_read_by_the_simulation() -> None:
    other = {**SMALL, "forced_tflops_per_gpu": 1.0, "dropless_tflops_per_gpu": 1e6}
    a, b = simulate_pair(SMALL, "force_biased:0.5"), simulate_pair(other, "force_biased:0.5")
    assert a["penalty"] == b["penalty"] and a["measured_penalty"] != b["measured_penalty"]


def test_implied_std_reproduces_the_measured_penalty() -> None:
    found = implied_std(SMALL, steps=5)
    assert found["std"] == found["std"]  # found (not NaN) within [0, 2]
    assert found["penalty"] >= found["target"] == pytest.approx(0.02)
    assert simulate_pair(SMALL, f"force_biased:{found['std'] / 2}")["penalty"] < found["target"]


def test_bad_sources_and_files_are_one_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="force_biased:STD"):
        simulate_pair(SMALL, "zipf")
    with pytest.raises(ConfigError, match="no measured popularity"):
        simulate_pair(SMALL, "popularity")
    bad = tmp_path / "penalty.json"
    bad.write_text(json.dumps({"rows": [{**SMALL, "role": "calibration"}]}))
    assert validate_main(["--penalty", "--data", str(bad)]) == 2
    assert "role must be 'check'" in capsys.readouterr().err
    assert validate_main(["--penalty", "--sources", ""]) == 2
    assert validate_main(["--sources", "popularity"]) == 2


def test_a_row_with_needs_is_listed_not_simulated(tmp_path: Path) -> None:
    path = tmp_path / "penalty.json"
    path.write_text(json.dumps({"rows": [{**SMALL, "needs": "something"}]}))
    table = penalty_table(path, ("force_biased:0.5",))
    assert list(table.needs) == ["something"] and "penalty" not in table


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "qwen3-moe-counts").is_dir(), reason="needs ../shared qwen3-moe-counts")
def test_the_16k_penalty_on_qwen3_popularity_is_within_a_quarter_of_measured() -> None:
    """The issue's target, on the 16K row with the model's real per-layer popularity (about 20 s): the
    simulated penalty within 25 % of the measured one (0.215 / 0.245 when recorded)."""
    sim = simulate_pair(load_penalty_rows()["rows"][0], "popularity")
    assert abs(sim["penalty"] / sim["measured_penalty"] - 1) <= 0.25
    assert 1.6 < sim["dropless_skew"] < 1.9  # the repo's identity r_avg at EP 8: 1.737
