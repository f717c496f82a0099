"""W&B read-back: a cell logged offline is read back from its ``.wandb`` file and equals its results file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis.wandb_offline import _records, find_offline_runs, read_offline_run
from experiments.config.presets import compose_cell
from experiments.run import run

TINY = [
    "planner=megatron",
    "cluster.nodes=1",
    "trace.num_batches=1",
    "trace.samples_per_batch=16",
    "trace.max_tokens=128",
    "logger=wandb",
]


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_logged_cell_reads_back_equal_to_its_results_file(offline: Path) -> None:
    cfg = compose_cell("quick_ep_scaling", TINY)
    run_dir = offline / "cell"
    returned = run(cfg, run_dir=run_dir)
    results = pd.read_parquet(run_dir / "results.parquet")
    pd.testing.assert_frame_equal(returned.reset_index(drop=True), results)
    runs = find_offline_runs(run_dir)
    assert len(runs) == 1, f"expected one offline run under {run_dir}, found {runs}"
    logged = read_offline_run(runs[0])

    row = results.iloc[0]
    assert logged.group == "quick_ep_scaling"
    assert logged.config["planner"]["name"] == "megatron"
    assert logged.config["model"]["name"] == row["model"]
    numeric = [c for c in results.columns if pd.api.types.is_numeric_dtype(results[c])]
    assert "step_time_s" in numeric and "skew_mean" in numeric
    for col in numeric:
        assert logged.summary[col] == pytest.approx(float(row[col]), rel=1e-12), col
        assert logged.history[0][col] == pytest.approx(float(row[col]), rel=1e-12), col
    for col in ("model", "dataset", "planner"):
        assert logged.summary[col] == row[col]

    per_layer = pd.read_parquet(run_dir / "per_layer.parquet")
    table = logged.table("per_layer")
    assert list(table.columns) == list(per_layer.columns) and len(table) == len(per_layer)
    np.testing.assert_allclose(table["skew"].to_numpy(float), per_layer["skew"].to_numpy(float), rtol=1e-12)


def test_failing_wandb_does_not_lose_the_results(offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("W&B is down")

    monkeypatch.setattr(wandb, "init", broken)
    cfg = compose_cell("quick_ep_scaling", TINY)
    with pytest.warns(RuntimeWarning, match="W&B logging failed"):
        results = run(cfg, run_dir=offline / "cell")
    pd.testing.assert_frame_equal(
        results.reset_index(drop=True), pd.read_parquet(offline / "cell" / "results.parquet")
    )


def test_reader_refuses_files_that_are_not_wandb_runs() -> None:
    with pytest.raises(ValueError, match="not a W&B run file"):
        _records(b"PAR1" + bytes(64))
    with pytest.raises(ValueError, match="corrupt"):
        _records(b":W&B\xe1\xbe\x00" + bytes([0, 0, 0, 0, 0xFF, 0x7F, 1]) + b"short")


def test_rerun_of_a_finished_cell_logs_no_second_run(offline: Path) -> None:
    cfg = compose_cell("quick_ep_scaling", [*TINY, f"results_dir={offline / 'store'}"])
    first = run(cfg, run_dir=offline / "first")
    again = run(cfg, run_dir=offline / "again")
    pd.testing.assert_frame_equal(first.reset_index(drop=True), again.reset_index(drop=True))
    assert len(find_offline_runs(offline / "first")) == 1
    assert find_offline_runs(offline / "again") == []
    assert (offline / "again" / "results.parquet").is_file()
