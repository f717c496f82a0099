"""``reproduce`` over a store it cannot trust: refused presets, a damaged ``grid.json``, a read-only root,
lost per-layer tables, and concurrent sweeps' counts."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.grid import cli, runner
from experiments.store.results_store import ResultsStore

TINY = ["trace.num_batches=1", "trace.samples_per_batch=16", "trace.max_tokens=64", "cluster.nodes=1"]
TWO = ["--presets", "quick_ep_scaling", "--workers", "1", *TINY, "planner=megatron,relibra"]
"""Two tiny cells of one preset (one 8-GPU node, one step of 16 rollouts)."""


def test_a_mixed_version_preset_gets_no_tables_and_reproduce_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--results", str(tmp_path), *TWO]) == 0
    tables = tmp_path / "analysis" / "quick_ep_scaling.skew_by_ep.md"
    assert tables.is_file()
    store = ResultsStore(tmp_path / "quick_ep_scaling")
    key = store.keys()[0]
    store.write(key, store.read(key).assign(code_version="0.1.0+gother"), store.config(key))
    capsys.readouterr()
    assert cli.main(["--results", str(tmp_path), *TWO]) == 1
    out = capsys.readouterr().out
    assert "quick_ep_scaling: tables refused" in out and "2 code versions" in out, out
    assert not list((tmp_path / "analysis").rglob("quick_ep_scaling.*"))


def test_a_lost_per_layer_table_is_recomputed_not_counted_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--results", str(tmp_path), "--no-analysis", *TWO]
    assert cli.main(args) == 0
    store = ResultsStore(tmp_path / "quick_ep_scaling")
    lost = store.keys()[0]
    store.per_layer_path(lost).unlink()
    capsys.readouterr()
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "quick_ep_scaling: 1 cells run, 1 reused" in out, out
    assert store.per_layer_path(lost).is_file() and store.contents().lost_per_layer == []


@pytest.mark.parametrize("damage", ['["0123', '{"a": 1}', "dir"])
def test_a_damaged_grid_json_is_named_and_replaced_or_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """The issue's probe: a corrupt grid.json wedged the store (a JSONDecodeError from analysis and
    reproduce). Now: reproduce replaces it, saying so; --extend-grid and the analysis refuse it, exit 2,
    naming the file."""
    from analysis.__main__ import main as analysis

    args = ["--results", str(tmp_path), "--no-analysis", *TWO]
    assert cli.main(args) == 0
    grid = tmp_path / "quick_ep_scaling" / "grid.json"
    grid.unlink()
    if damage == "dir":
        grid.mkdir()
    else:
        grid.write_text(damage)
    capsys.readouterr()
    assert analysis([str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(grid) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
    assert cli.main([*args, "--extend-grid"]) == 2
    err = capsys.readouterr().err
    assert str(grid) in err and "--extend-grid" in err and len(err.strip().splitlines()) == 1, err
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "grid.json was damaged" in out and "0 cells run, 2 reused" in out, out
    assert len(ResultsStore(tmp_path / "quick_ep_scaling").grid_keys() or ()) == 2


def test_analyse_refuses_a_store_with_a_damaged_grid_and_builds_the_rest(tmp_path: Path) -> None:
    """What reproduce's analysis sees for a preset it did not run now: that preset refused, named."""
    from analysis.__main__ import analyse
    from tests.analysis.test_analysis import MODELS, _row, _write

    _write(tmp_path, "quick_overhead", [_row(m, "mixed", "relibra", 4) for m in MODELS])
    _write(
        tmp_path,
        "quick_ep_scaling",
        [_row("m", "mixed", p, n) for n in (1, 2) for p in ("megatron", "relibra")],
    )
    (tmp_path / "quick_ep_scaling" / "grid.json").write_text("[")
    out = analyse(tmp_path, tmp_path / "out")
    assert len(out.refused) == 1 and "quick_ep_scaling" in out.refused[0] and "grid.json" in out.refused[0]
    assert [p for p in out.tables if p.name.startswith("quick_overhead.")]


def test_an_unwritable_results_root_is_refused_before_the_trace_is_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's probe (a read-only root: the OLMoE trace was written before the writability check).
    NOTE: a folder where a file is stands in for a read-only mount, which root cannot be denied by mode."""
    shared = tmp_path / "shared"
    (shared / "olmoe-decode").mkdir(parents=True)
    monkeypatch.setattr(cli, "SHARED_TRACES", shared)
    (tmp_path / "file").write_text("not a folder")
    root = tmp_path / "file" / "results"
    assert cli.main(["--results", str(root), "--presets", "quick_real_trace", "--no-analysis"]) == 2
    err = capsys.readouterr().err
    assert "--results" in err and "is a file, not a directory" in err and len(err.strip().splitlines()) == 1


def test_an_unwritable_analysis_out_is_refused_before_any_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from analysis.__main__ import main as analysis
    from tests.analysis.test_analysis import MODELS, _row, _write

    _write(tmp_path / "r", "quick_overhead", [_row(m, "mixed", "relibra", 4) for m in MODELS])
    (tmp_path / "file").write_text("not a folder")
    assert analysis([str(tmp_path / "r"), "--out", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a file, not a directory" in err and len(err.strip().splitlines()) == 1


def test_a_cell_another_sweep_finished_is_counted_reused_not_computed(tmp_path: Path) -> None:
    """The issue's probe: of two concurrent sweeps, the one that only read cells back said "5 cells
    computed". A job planned while its cell was missing and read back when it ran is a reused cell."""
    from rich.console import Console

    from experiments.grid.progress import Lines, Tracker

    report, jobs = runner.plan_grid("quick_ep_scaling", tmp_path, [*TINY, "planner=megatron"])
    assert len(jobs) == 1
    other = runner.run_cell_job(jobs[0])  # NOTE: the other sweep computes the cell first
    assert other.error is None and not other.read_back
    outcome = runner.run_cell_job(jobs[0])
    assert outcome.error is None and outcome.read_back
    tracker = Tracker(Lines(Console(width=200)))
    tracker.add(report, 1)
    tracker.done(jobs[0], outcome)
    assert (report.ran, report.reused, tracker.computed) == (0, 1, 0)
    assert tracker.line().startswith("0 cells computed")
