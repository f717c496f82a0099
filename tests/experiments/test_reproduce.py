"""`make reproduce`'s runner: cells in worker processes, plain progress lines, failures listed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from experiments import inputs
from experiments.config.errors import ConfigError
from experiments.grid import cli, runner
from experiments.grid.jobs import CellJob, CellOutcome
from experiments.store.results_store import ResultsStore

TINY = ["trace.num_batches=1", "trace.samples_per_batch=16", "trace.max_tokens=64", "cluster.nodes=1"]
"""Tiny cells: one step of two rollouts per GPU of one 8-GPU node."""
PLANNERS = ["megatron", "relibra", "relibra_portfolio", "ultraep"]
SWEEP = [*TINY, f"planner={','.join(PLANNERS)}"]
"""Four planners (a sweep that replaces the preset's), one online baseline among them."""


def _rows(root: Path) -> pd.DataFrame:
    frame = ResultsStore(root / "quick_ep_scaling").load()
    return frame.sort_values("planner").reset_index(drop=True)


def test_workers_compute_the_same_cells_as_one_process(tmp_path: Path) -> None:
    """Two worker processes store exactly the rows that one process stores, cell for cell."""
    args = ["--presets", "quick_ep_scaling", "--no-analysis", *SWEEP]
    assert cli.main(["--results", str(tmp_path / "one"), "--workers", "1", *args]) == 0
    assert cli.main(["--results", str(tmp_path / "two"), "--workers", "2", *args]) == 0
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert sorted(one["planner"]) == PLANNERS
    metrics = ["planner", "step_time_s", "skew_mean", "reorder_moved_experts", "t_comm_s"]
    pd.testing.assert_frame_equal(one[metrics], two[metrics], check_exact=True)


def test_plain_output_prints_one_line_per_finished_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a terminal (CI, `| tee`): a line per cell with preset, done/total, cell, seconds, state."""
    args = ["--results", str(tmp_path), "--presets", "quick_ep_scaling", "--workers", "1"]
    assert cli.main([*args, "--no-analysis", *SWEEP]) == 0
    out = capsys.readouterr().out
    assert "quick_ep_scaling: 4 cells, 0 reused, 4 to compute" in out
    line = r"^quick_ep_scaling \[(\d)/4\] qwen3-30b-a3b mixed EP8 (\S+): [\d.]+ s done$"
    lines = re.findall(line, out, re.M)
    assert sorted(int(done) for done, _ in lines) == [1, 2, 3, 4]
    assert sorted(planner for _, planner in lines) == PLANNERS
    assert "quick_ep_scaling: 4 cells run, 0 reused, 0 failed" in out

    assert cli.main([*args, "--no-analysis", *SWEEP]) == 0  # a rerun: every cell reused, no lines
    out = capsys.readouterr().out
    assert "quick_ep_scaling: 4 cells, 4 reused, 0 to compute" in out and "[1/4]" not in out


def test_a_failing_cell_in_a_worker_is_listed_and_the_others_finish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cell that raises in its worker is reported at the end (exit 1); its neighbours are stored."""
    args = ["--results", str(tmp_path), "--presets", "quick_ep_scaling", "--workers", "2", "--no-analysis"]
    # NOTE: EP 24 composes but its run refuses it (128 experts do not divide over 24 GPUs).
    rc = cli.main([*args, *TINY[:-1], "cluster.nodes=1,3", "planner=megatron,relibra"])
    out = capsys.readouterr().out
    assert rc == 1
    assert out.count("FAILED") == 2 and "2 cells run, 0 reused, 2 failed" in out
    assert re.search(r"failed\S* cluster.nodes=3 planner=megatron .*: ConfigError: .*cluster.nodes", out)
    planners = ResultsStore(tmp_path / "quick_ep_scaling").load()["planner"]
    assert sorted(planners) == ["megatron", "relibra"]


SHARED = {
    "quick_overall": ["model=qwen3-30b-a3b", "trace.preset=mixed,reasoning", "planner=megatron,relibra"],
    "quick_ablation": ["model=qwen3-30b-a3b", "trace.preset=mixed", "planner=megatron,relibra_reorder_only"],
    "quick_overhead": ["model=qwen3-30b-a3b", "planner=relibra"],
}
"""Three presets whose grids share two cells: megatron and relibra on the mixed dataset."""


def _planned(root: Path) -> list[CellJob]:
    return [
        job for preset, sweep in SHARED.items() for job in runner.plan_grid(preset, root, [*TINY, *sweep])[1]
    ]


def test_presets_planned_in_worker_processes_are_those_planned_in_one(tmp_path: Path) -> None:
    """plan_grids with two spawned planners returns, in the order given, the reports and jobs (cells,
    configs, keys) that planning each preset here returns."""
    plans = [(preset, [*TINY, *sweep]) for preset, sweep in SHARED.items()]
    one = runner.plan_grids(plans, tmp_path / "one", workers=1)
    two = runner.plan_grids(plans, tmp_path / "two", workers=2)
    assert [report.preset for report, _ in two] == list(SHARED)
    for (report1, jobs1), (report2, jobs2) in zip(one, two, strict=True):
        assert (report1.total, report1.reused, report1.failed) == (
            report2.total,
            report2.reused,
            report2.failed,
        )
        assert [(j.preset, j.cell, j.label, j.key) for j in jobs1] == [
            (j.preset, j.cell, j.label, j.key) for j in jobs2
        ]
        for a, b in zip(jobs1, jobs2, strict=True):  # the same run config, up to its own results folder
            assert repr(a.spec).replace(str(tmp_path / "one"), "R") == repr(b.spec).replace(
                str(tmp_path / "two"), "R"
            )


def test_worker_planners_extend_the_recorded_grid_as_one_does(tmp_path: Path) -> None:
    """`extend_grid` reaches the spawned planners: each preset's grid.json becomes the union of the grid
    recorded before and the planned keys, and without it the planned keys alone (`left_out` counts finished
    cells only, so none here)."""
    plans = [(preset, [*TINY, *sweep]) for preset, sweep in SHARED.items()]
    stores = [ResultsStore(tmp_path / preset) for preset in SHARED]
    for store in stores:
        store.write_grid(["0123456789abcdef"])
    planned = runner.plan_grids(plans, tmp_path, workers=2, extend_grid=True)
    for store, (report, jobs) in zip(stores, planned, strict=True):
        assert store.grid_keys() == {"0123456789abcdef", *(j.key for j in jobs)} and report.left_out == 0
    planned = runner.plan_grids(plans, tmp_path, workers=2)
    for store, (_, jobs) in zip(stores, planned, strict=True):
        assert store.grid_keys() == {j.key for j in jobs}


def test_a_preset_that_cannot_be_planned_stops_the_planning_in_workers(tmp_path: Path) -> None:
    """A preset every cell of which is refused raises its ConfigError from plan_grids, as from plan_grid,
    naming the preset."""
    plans = [(p, [*TINY, *s]) for p, s in SHARED.items()]
    plans[1] = (plans[1][0], [*plans[1][1], "trace.samples_per_batch=2"])
    with pytest.raises(
        ConfigError, match=re.escape("preset quick_ablation: bad configuration: trace.samples_per_batch=2")
    ):
        runner.plan_grids(plans, tmp_path, workers=2)


def test_schedule_computes_each_cell_once_grouped_by_trace(tmp_path: Path) -> None:
    jobs = _planned(tmp_path)
    todo, copies = runner.schedule(jobs)
    assert len(jobs) == 7 and len(todo) == 5
    assert len({job.key for job in todo}) == 5  # each computation once
    assert sorted((job.preset, job.label.split()[-1]) for twins in copies.values() for job in twins) == [
        ("quick_ablation", "megatron"),
        ("quick_overhead", "relibra"),
    ]
    for key, twins in copies.items():  # a copy is the same computation as the job it copies
        (source,) = [job for job in todo if job.key == key]
        assert all(job.preset != source.preset and job.key == key for job in twins)
    datasets = [job.label.split()[1] for job in todo]
    assert datasets == sorted(datasets, key=datasets.index)  # one trace's cells one after another


def test_schedule_puts_the_largest_traces_first(tmp_path: Path) -> None:
    jobs = [
        *runner.plan_grid("quick_overall", tmp_path, [*TINY, "model=qwen3-30b-a3b", "planner=megatron"])[1],
        *runner.plan_grid("quick_overall", tmp_path, [*TINY[1:], "trace.num_batches=2", "planner=megatron"])[
            1
        ],
    ]
    todo, _ = runner.schedule(jobs)
    batches = [job.spec.trace.num_batches for job in todo if not isinstance(job.spec, str)]  # str: refused
    assert batches[0] == 2 and batches[-1] == 1 and batches == sorted(batches, reverse=True)


def test_cells_shared_by_presets_are_computed_once_and_copied(tmp_path: Path) -> None:
    """The same cell key in several presets: computed once, stored in each (equal rows), the copy says so."""
    done: list[tuple[CellJob, CellOutcome]] = []
    inputs.clear_cache()  # NOTE: in this process; earlier tests may have left the same traces in it
    runner.run_jobs(_planned(tmp_path), 1, lambda job, outcome: done.append((job, outcome)))
    assert len(done) == 7 and all(outcome.error is None for _, outcome in done)
    copied = [(job, outcome) for job, outcome in done if outcome.copied_from is not None]
    assert sorted((job.preset, outcome.copied_from) for job, outcome in copied) == [
        ("quick_ablation", "quick_overall"),
        ("quick_overhead", "quick_overall"),
    ]
    assert sum(outcome.trace_generated for _, outcome in done) == 2  # mixed and reasoning, once each
    source = ResultsStore(tmp_path / "quick_overall")
    for job, _ in copied:
        store = ResultsStore(tmp_path / job.preset)
        pd.testing.assert_frame_equal(store.read(job.key), source.read(job.key), check_exact=True)
        pd.testing.assert_frame_equal(store.read_per_layer(job.key), source.read_per_layer(job.key))
        assert store.config(job.key)["results_dir"] == str(tmp_path / job.preset)  # its own config
        summary = json.loads((job.run_dir / "summary.json").read_text())
        assert summary["reused_from"] == str(source.cell_path(job.key))
        assert summary["rows"][0]["step_time_s"] == source.read(job.key)["step_time_s"][0]


def test_main_reports_copied_cells_and_fails_the_copies_of_a_failed_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--results", str(tmp_path), "--presets", "quick_overall,quick_overhead", "--no-analysis"]
    cell = [*TINY[:-1], "model=qwen3-30b-a3b", "trace.preset=mixed", "planner=relibra"]
    assert cli.main([*argv, "--workers", "1", *cell, "cluster.nodes=1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^quick_overhead \[1/1\] .* relibra: [\d.]+ s copied from quick_overall", out, re.M)
    assert "quick_overhead: 0 cells run, 0 reused, 0 failed, 1 copied from the same cell" in out
    assert "1 cells computed, 1 copied" in out
    # NOTE: a cell that passes validation but fails while it runs (here: in this process, --workers 1);
    # the copy fails with the cell it copies. (A grid every cell of which is refused by validation is
    # refused before it starts: test_faults.py::test_reproduce_refuses_a_bad_override_once_before_the_grid.)
    import experiments.run as run_module

    def failing(cfg, checked=False):
        raise RuntimeError("planner crashed")

    monkeypatch.setattr(run_module, "compute", failing)
    assert cli.main([*argv, "--workers", "1", *cell, "cluster.nodes=1", "seed=1"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAILED") == 2 and "same cell as quick_overall's, which failed: RuntimeError" in out


def test_a_narrowed_sweep_replaces_the_grid_unless_extended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`seed=1` after a finished `seed=0` records only seed 1 (and says what it leaves out);
    `--extend-grid` adds to the recorded grid instead, so the analysis reads both seeds."""
    argv = ["--results", str(tmp_path), "--presets", "quick_ep_scaling", "--workers", "1", "--no-analysis"]
    cell = [*TINY, "planner=megatron"]
    store = ResultsStore(tmp_path / "quick_ep_scaling")

    assert cli.main([*argv, *cell, "seed=0"]) == 0
    (seed0,) = store.grid_keys() or set()
    assert "not in this one" not in capsys.readouterr().out

    assert cli.main([*argv, *cell, "seed=1"]) == 0
    out = capsys.readouterr().out
    assert "1 finished cells of the grid recorded before are not in this one" in out
    (seed1,) = store.grid_keys() or set()
    assert seed1 != seed0 and set(store.load()["cell"]) == {seed1}
    assert set(store.load(all_cells=True)["cell"]) == {seed0, seed1}  # nothing was deleted

    assert cli.main([*argv, "--extend-grid", *cell, "seed=0"]) == 0
    out = capsys.readouterr().out
    assert "quick_ep_scaling: 1 cells, 1 reused, 0 to compute" in out and "not in this one" not in out
    assert "trace seeds run now: quick_ep_scaling: 1 (--extend-grid kept the grid's earlier cells" in out
    assert "show no spread" not in out  # the grid holds two seeds now: the line does not claim one
    assert store.grid_keys() == {seed0, seed1}
    assert set(store.load()["cell"]) == {seed0, seed1}
