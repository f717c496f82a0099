"""A hostile but fair user: every bad input is one line naming it and exit 2; nothing computed is lost.

Covers the entry point (``run``, the CLI, its multirun sweeper), run-directory hygiene, W&B without a
network, ``reproduce`` over a store with an unreadable cell, and ``code_version`` of uncommitted edits.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import experiments.run as run_module
from experiments.config import ConfigError
from experiments.run import run
from experiments.store import ResultsStore, cell_key
from tests.builders import REPO, cfg, file_cfg

TINY = [
    "model=olmoe-1b-7b",
    "trace.num_batches=1",
    "trace.samples_per_batch=8",
    "trace.max_tokens=64",
    "cluster.nodes=1",
    "cluster.gpus_per_node=4",
]


def _trace_arrays(num_experts: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    lens = np.array([5, 7, 3, 9])
    experts = np.argsort(rng.random((int(lens.sum()), 16, num_experts)), axis=-1)[..., :8].astype(np.int16)
    meta = {"num_experts": num_experts, "top_k": 8, "num_layers": 16, "model": "olmoe", "source": "test"}
    return {
        "experts": experts,
        "sample_offsets": np.r_[0, np.cumsum(lens)].astype(np.int64),
        "batch_offsets": np.array([0, 4], dtype=np.int64),
        "meta": np.array(json.dumps(meta)),
    }


def _meta(**changes: object) -> np.ndarray:
    meta = json.loads(str(_trace_arrays()["meta"]))
    return np.array(json.dumps({**meta, **changes}))


# Each bad trace: (what to change, the array its message must name).
BAD_TRACES = {
    "float32 experts": ({"experts": lambda a: a.astype(np.float32)}, "'experts'"),
    "int64 experts": ({"experts": lambda a: a.astype(np.int64)}, "'experts'"),
    "rank-2 experts": ({"experts": lambda a: a[:, 0]}, "'experts'"),
    "decreasing offsets": ({"sample_offsets": lambda a: a[::-1].copy()}, "'sample_offsets'"),
    "0 samples": ({"sample_offsets": lambda a: a[:1]}, "'sample_offsets'"),
    "a 0-token sample": ({"sample_offsets": lambda a: np.r_[a[:2], a[1:]]}, "'sample_offsets'"),
    "ids out of range": ({"experts": lambda a: np.where(a == 0, 64, a).astype(np.int16)}, "'experts'"),
    "missing array": ({"sample_offsets": None}, "'sample_offsets'"),
    "missing meta key": (
        {
            "meta": lambda a: np.array(
                json.dumps({k: v for k, v in json.loads(str(a)).items() if k != "top_k"})
            )
        },
        "'meta'",
    ),
    "num_experts=64.5": ({"meta": lambda a: _meta(num_experts=64.5)}, "'meta'"),
    "num_experts=sixty-four": ({"meta": lambda a: _meta(num_experts="sixty-four")}, "'meta'"),
}


def _bad_trace(path: Path, case: str) -> Path:
    arrays = _trace_arrays()
    for name, change in BAD_TRACES[case][0].items():
        if change is None:
            del arrays[name]
        else:
            arrays[name] = change(arrays[name])
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


@pytest.fixture
def no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(cfg):
        raise AssertionError("a refused config was computed")

    monkeypatch.setattr(run_module, "compute", must_not_run)


@pytest.mark.parametrize("case", sorted(BAD_TRACES))
def test_bad_trace_content_is_a_config_error_naming_the_array(case, tmp_path, no_compute) -> None:
    path = _bad_trace(tmp_path / "bad.npz", case)
    with pytest.raises(ConfigError) as err:
        run(file_cfg(path), run_dir=tmp_path / "run")
    message = str(err.value)
    assert f"trace.path={path}" in message and BAD_TRACES[case][1] in message, message
    assert "\n" not in message and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("workload.samples_per_microbatch=0", "workload.samples_per_microbatch=0"),
        ("workload.samples_per_microbatch=-3", "workload.samples_per_microbatch=-3"),
        ("workload.samples_per_microbatch=two", "workload.samples_per_microbatch='two'"),
        ("trace.num_batches=0", "trace.num_batches=0"),
        ("trace.samples_per_batch=0", "trace.samples_per_batch=0"),
        ("trace.max_tokens=0", "trace.max_tokens=0"),
        ("trace.max_tokens=-5", "trace.max_tokens=-5"),
        ("trace.preset=nosuch", "trace.preset=nosuch"),
        ("cluster.calibration=/missing.json", "cluster.calibration=/missing.json"),
        ("cluster.nodes=abc", "cluster.nodes='abc'"),
        ("seed=abc", "seed='abc'"),
        ("model.num_experts=sixty-four", "model.num_experts='sixty-four'"),
        ("model.num_experts=64.5", "model.num_experts=64.5"),
        ("+results_dir=/proc/relibra-results", "results_dir=/proc/relibra-results"),
    ],
)
def test_bad_key_is_one_line_naming_it(override, key, tmp_path, no_compute) -> None:
    with pytest.raises(ConfigError) as err:
        run(cfg(*TINY, override), run_dir=tmp_path / "run")
    assert key in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


def test_tokens_per_microbatch_zero_is_refused(tmp_path, no_compute) -> None:
    overrides = ["workload.samples_per_microbatch=null", "workload.tokens_per_microbatch=0"]
    with pytest.raises(ConfigError, match=r"workload\.tokens_per_microbatch=0: must be >= 1"):
        run(cfg(*TINY, *overrides), run_dir=tmp_path)


def test_read_only_results_dir_is_refused_before_computing(tmp_path, no_compute) -> None:
    store = tmp_path / "store"
    store.mkdir()
    store.chmod(0o555)
    immutable = False
    if os.access(store, os.W_OK):  # root ignores mode bits; an immutable folder stops root too
        immutable = subprocess.run(["chattr", "+i", str(store)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("cannot make a folder read-only for this user here (root without chattr)")
    try:
        with pytest.raises(ConfigError, match=rf"results_dir={store}: .*not writable"):
            run(cfg(*TINY, f"+results_dir={store}"), run_dir=tmp_path / "run")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(store)], check=True)
        store.chmod(0o755)


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "experiments.run", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_trace_content_error_is_one_line_and_exit_2_and_keeps_the_old_run(tmp_path) -> None:
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        (run_dir / ".hydra" / name).write_text(f"earlier run's {name}\n")
    (run_dir / "results.parquet").write_bytes(b"earlier results")
    bad = _bad_trace(tmp_path / "bad.npz", "float32 experts")
    proc = _cli(f"trace.path={bad}", "model=olmoe-1b-7b", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "'experts'" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
    for name in ("config.yaml", "overrides.yaml", "hydra.yaml"):
        assert (run_dir / ".hydra" / name).read_text() == f"earlier run's {name}\n"
    assert (run_dir / "results.parquet").read_bytes() == b"earlier results"


def test_multirun_with_one_bad_cell_is_refused_before_any_cell_runs(tmp_path) -> None:
    store, sweep = tmp_path / "store", tmp_path / "sweep"
    proc = _cli(
        "--multirun",
        *TINY,
        "planner=megatron",
        "planner.replica_slots=0,999",
        f"+results_dir={store}",
        f"hydra.sweep.dir={sweep}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "planner.replica_slots=999" in lines[0], proc.stderr
    assert not store.exists() and not sweep.exists()  # not even the good cell ran


def test_reused_cell_replaces_an_earlier_runs_files_and_says_what_it_lacks(tmp_path) -> None:
    store = tmp_path / "store"
    first = run(cfg(*TINY, "planner=megatron", f"+results_dir={store}"), run_dir=tmp_path / "a")
    # the directory held a run of another planner, with its plan dump
    other = tmp_path / "b"
    run(cfg(*TINY, "planner=eplb", "dump_plans=true"), run_dir=other)
    assert (other / "plans.npz").exists()
    again = run(cfg(*TINY, "planner=megatron", f"+results_dir={store}"), run_dir=other)
    pd.testing.assert_frame_equal(again, first)
    assert not (other / "plans.npz").exists()  # the old run's plans are not left beside the new results
    summary = json.loads((other / "summary.json").read_text())
    assert summary["files"] == ["per_layer.parquet", "results.parquet", "summary.json"]
    assert summary["rows"][0]["planner"] == "megatron"
    assert summary["not_written"] == {"plans.npz": "dump_plans=false"}
    assert summary["reused_from"].startswith(str(store / "cells"))
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["reused_from"] is None
    stored = ResultsStore(store).read_per_layer(
        cell_key(cfg(*TINY, "planner=megatron", f"+results_dir={store}"))
    )
    pd.testing.assert_frame_equal(pd.read_parquet(other / "per_layer.parquet"), stored)


def test_reused_cell_with_dump_plans_says_the_plans_were_not_produced(tmp_path) -> None:
    c = cfg(*TINY, "planner=megatron", "dump_plans=true", f"+results_dir={tmp_path / 'store'}")
    run(c, run_dir=tmp_path / "a")
    assert (tmp_path / "a" / "plans.npz").exists()
    run(c, run_dir=tmp_path / "b")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert not (tmp_path / "b" / "plans.npz").exists()
    assert "reused from the results store" in summary["not_written"]["plans.npz"]


@pytest.fixture
def blackhole() -> str:
    """A server that accepts connections and never answers (a W&B host behind a dead network)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for conn in held:
        conn.close()


def test_wandb_online_without_a_network_waits_once_and_keeps_results(
    tmp_path, monkeypatch, blackhole, request
) -> None:
    wandb = pytest.importorskip("wandb")
    # NOTE: wandb keeps the online settings in a process-wide singleton after the env is restored; tear it
    # down so later tests in this process log offline again.
    request.addfinalizer(wandb.teardown)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", blackhole)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    overrides = [*TINY, "logger=wandb", "logger.init_timeout_s=2"]
    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="W&B logging failed, local results are intact") as first:
        run(cfg(*overrides, "planner=megatron"), run_dir=tmp_path / "a")
    took = time.monotonic() - start
    assert took < 30, f"the first run waited {took:.0f} s for W&B"
    assert len(first) == 1
    start = time.monotonic()
    run(cfg(*overrides, "planner=eplb"), run_dir=tmp_path / "b")  # the grid's next cell: no wait, no warning
    assert time.monotonic() - start < 15
    for out in ("a", "b"):
        assert len(pd.read_parquet(tmp_path / out / "results.parquet")) == 1


def test_reproduce_lists_an_unreadable_cell_and_recomputes_it_without_stopping_the_others(tmp_path) -> None:
    from experiments.reproduce import run_grid

    overrides = [*TINY, "planner=megatron", "trace.preset=reasoning,coding,mixed"]
    first = run_grid("quick_overhead", tmp_path, overrides)
    assert (first.ran, first.failed) == (3, [])
    store = ResultsStore(tmp_path / "quick_overhead")
    victim = store.keys()[1]
    with open(store.cell_path(victim), "r+b") as fh:
        fh.truncate(1000)
    again = run_grid("quick_overhead", tmp_path, overrides)
    assert (again.ran, again.reused, again.failed) == (1, 2, [])
    assert again.corrupt == [str(store.cell_path(victim))]
    assert len(store.load()) == 3 and store.corrupt_keys() == []


def test_code_version_tells_two_uncommitted_edits_apart(tmp_path, monkeypatch) -> None:
    from relibra import provenance

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "code.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    monkeypatch.setattr(provenance, "_ROOT", repo)

    def version() -> str:
        provenance.code_version.cache_clear()
        return provenance.code_version()

    try:
        clean = version()
        (repo / "code.py").write_text("x = 2\n")
        edit_a = version()
        (repo / "code.py").write_text("x = 3\n")
        edit_b = version()
        (repo / "code.py").write_text("x = 2\n")
        edit_a_again = version()
    finally:
        provenance.code_version.cache_clear()
    assert ".dirty" not in clean and edit_a.startswith(clean + ".dirty.")
    assert edit_a != edit_b and edit_a == edit_a_again


def test_reproduce_refuses_an_unwritable_results_root_before_any_cell(tmp_path, capsys) -> None:
    from experiments.reproduce import main as reproduce

    (tmp_path / "file").write_text("not a folder")
    code = reproduce(["--results", str(tmp_path / "file"), "--presets", "quick_overhead", "--no-analysis"])
    assert code == 2
    assert "cannot write" in capsys.readouterr().out


def test_reused_cell_with_an_unreadable_per_layer_table_says_so(tmp_path) -> None:
    c = cfg(*TINY, "planner=megatron", f"+results_dir={tmp_path / 'store'}")
    run(c, run_dir=tmp_path / "a")
    with open(ResultsStore(tmp_path / "store").per_layer_path(cell_key(c)), "r+b") as fh:
        fh.truncate(100)
    run(c, run_dir=tmp_path / "b")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["reused_from"] and "per_layer.parquet" in summary["not_written"]
    assert not (tmp_path / "b" / "per_layer.parquet").exists()
