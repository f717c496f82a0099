"""``reproduce`` over a store it cannot trust: refused presets, a damaged ``grid.json``, a read-only root,
lost per-layer tables, and concurrent sweeps' counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments import reproduce
from experiments.store import ResultsStore

TINY = ["trace.num_batches=1", "trace.samples_per_batch=16", "trace.max_tokens=64", "cluster.nodes=1"]
TWO = ["--presets", "quick_ep_scaling", "--workers", "1", *TINY, "planner=megatron,relibra"]
"""Two tiny cells of one preset (one 8-GPU node, one step of 16 rollouts)."""


def test_a_mixed_version_preset_gets_no_tables_and_reproduce_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert reproduce.main(["--results", str(tmp_path), *TWO]) == 0
    tables = tmp_path / "analysis" / "quick_ep_scaling.skew_by_ep.md"
    assert tables.is_file()
    store = ResultsStore(tmp_path / "quick_ep_scaling")
    key = store.keys()[0]
    store.write(key, store.read(key).assign(code_version="0.1.0+gother"), store.config(key))
    capsys.readouterr()
    assert reproduce.main(["--results", str(tmp_path), *TWO]) == 1
    out = capsys.readouterr().out
    assert "quick_ep_scaling: tables refused" in out and "2 code versions" in out, out
    assert not list((tmp_path / "analysis").rglob("quick_ep_scaling.*"))


def test_a_lost_per_layer_table_is_recomputed_not_counted_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--results", str(tmp_path), "--no-analysis", *TWO]
    assert reproduce.main(args) == 0
    store = ResultsStore(tmp_path / "quick_ep_scaling")
    lost = store.keys()[0]
    store.per_layer_path(lost).unlink()
    capsys.readouterr()
    assert reproduce.main(args) == 0
    out = capsys.readouterr().out
    assert "quick_ep_scaling: 1 cells run, 1 reused" in out, out
    assert store.per_layer_path(lost).is_file() and store.contents().lost_per_layer == []
