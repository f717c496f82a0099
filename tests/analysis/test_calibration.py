"""Calibration statistics: LPT placement, the statistics on hand-made loads, and the command."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analysis.calibration import calibration_table, load_stats, lpt_placement, main
from relibra.types import SampleCounts


def test_lpt_respects_capacity_and_balances() -> None:
    loads = np.array([[8, 7, 6, 5, 4, 3, 2, 1]], dtype=float)
    home = lpt_placement(loads, 4)
    assert np.all(np.bincount(home[0], minlength=4) == 2)
    per_gpu = np.bincount(home[0], weights=loads[0], minlength=4)
    assert per_gpu.max() == 9  # LPT pairs 8+1, 7+2, 6+3, 5+4
    with pytest.raises(ValueError, match="multiple"):
        lpt_placement(np.ones((1, 6)), 4)


def counts_from_mb(loads: np.ndarray) -> SampleCounts:
    """One sample per micro-batch, with its [L, E] loads."""
    loads = loads.astype(np.int32)
    tokens = loads.sum(-1)[:, 0] // 1
    return SampleCounts(
        counts=loads, tokens=tokens.astype(np.int64), batch_offsets=np.array([0, loads.shape[0]]), top_k=1
    )


def test_statistics_on_alternating_hot_experts() -> None:
    # 4 micro-batches over 8 experts: the hot expert alternates between 0 and 1 every micro-batch.
    loads = np.ones((4, 1, 8)) * 10
    loads[0::2, 0, 0] = 80
    loads[1::2, 0, 1] = 80
    stats = load_stats(counts_from_mb(loads), samples_per_mb=1, num_gpus=2)
    assert stats["hot_change"] == 1.0
    assert stats["mb_max_mean"] == pytest.approx(80 / (150 / 8))
    assert stats["skew_per_mb"] <= stats["skew_static"]
    steady = np.ones((4, 1, 8)) * 10
    steady[:, 0, 0] = 80
    calm = load_stats(counts_from_mb(steady), samples_per_mb=1, num_gpus=2)
    assert calm["hot_change"] == 0.0 and calm["top8_jaccard"] == 1.0
    assert calm["skew_static"] == pytest.approx(calm["skew_per_mb"])


def test_table_and_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    table = calibration_table(tmp_path / "absent", synthetic=True)
    assert {"synthetic:reasoning", "synthetic:mixed"} <= set(table["workload"])
    assert table["skew_static"].notna().all()
    main(["--traces", str(tmp_path / "absent"), "--markdown"])
    assert "synthetic:coding" in capsys.readouterr().out


@pytest.mark.shared_traces
def test_presets_fall_inside_the_real_range(shared_traces: Path) -> None:
    table = calibration_table(shared_traces).set_index("workload")
    # E=64 real traces with micro-batches (Mixtral's 8 experts make EP8 trivial; Qwen3 is aggregate only).
    real = table[(table.index.str.startswith(("olmoe", "flame")))]
    synth = table[table.index.str.startswith("synthetic:") & ~table.index.str.contains("@")]
    for col in ("mb_max_mean", "hot_change", "top8_jaccard", "skew_static", "skew_per_mb"):
        lo, hi = real[col].min(), real[col].max()
        assert synth[col].between(lo, hi).all(), (
            f"{col}: synthetic {synth[col].tolist()} outside [{lo}, {hi}]"
        )
    assert (synth["skew_static"] > synth["skew_per_mb"]).all()
