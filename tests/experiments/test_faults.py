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
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.spec import build_spec
from experiments.run import run
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore
from tests.builders import REPO, TINY_CELL, cfg, file_cfg


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
        # round two (issue 32): flags accept only booleans
        ("cluster.ep_overlap='false'", "cluster.ep_overlap='false': must be a boolean"),
        ("cluster.ep_overlap=no", "cluster.ep_overlap='no': must be a boolean"),
        ("dump_plans=maybe", "dump_plans='maybe': must be a boolean"),
        ("simulator.check_plans=maybe", "simulator.check_plans='maybe': must be a boolean"),
        ("control_plane.enabled=1", "control_plane.enabled=1: must be a boolean"),
        # ... every key range-checked before any work
        ("seed=99999999999999999999999", "seed=99999999999999999999999: must be <= 9223372036854775807"),
        ("seed=-1", "seed=-1: must be >= 0"),
        ("seed=null", "seed=null"),
        ("control_plane.workers=-1", "control_plane.workers=-1: must be >= 0"),
        ("control_plane.deadline_s=-5", "control_plane.deadline_s=-5: must be >= 0"),
        ("control_plane.locality_deadline_s=soon", "control_plane.locality_deadline_s='soon'"),
        ("simulator.history_window=-1", "simulator.history_window=-1: must be >= 0"),
        # ... nulls
        ("cluster.nodes=null", "cluster.nodes=null: must be an integer"),
        ("model.hidden=null", "model.hidden=null: must be an integer"),
        # ... the sliding window
        ("model.attention_window=0", "model.attention_window=0: must be >= 1"),
        ("model.attention_window=wide", "model.attention_window='wide': must be an integer"),
        ("model.windowed_layers=49", "model.windowed_layers=49: expected 0 to model.num_layers="),
        ("model.windowed_layers=4", "model.windowed_layers=4 needs model.attention_window"),
        ("model.windowed_layers=null", "model.windowed_layers=null: must be an integer"),
        ("cluster.hardware.nic_bytes_per_s=null", "cluster.hardware.nic_bytes_per_s=null: must be a number"),
        # ... keys no code reads, named with the closest known key
        ("+cluster.node=8", "cluster.node: unknown key"),
        ("+foo=1", "foo: unknown key"),
        ("+planner.replica_slot=2", "the closest known key is planner.replica_slots"),
    ],
)
def test_bad_key_is_one_line_naming_it(override, key, tmp_path, no_compute) -> None:
    with pytest.raises(ConfigError) as err:
        run(cfg(*TINY_CELL, override), run_dir=tmp_path / "run")
    assert key in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("planner=relibra", "planner.replicate.refill_aware=maybe"), "refill_aware='maybe': must be a"),
        (("planner=relibra", "planner.replica_slots=null"), "planner.replica_slots=null: must be an integer"),
        (("planner=relibra", "planner.reorder.seeds=[a]"), "planner.reorder.seeds=['a']; expected a list of"),
        (("executor=torch", "executor.hidden=-4"), "executor.hidden=-4: must be >= 1"),
        (("executor=torch", "executor.backend=mpi"), "executor.backend='mpi': choose one of gloo, nccl"),
        (("executor=torch", "executor.max_world=2"), "executor.max_world=2: the torch executor starts one"),
        (("executor=torch", "model=deepseek-v3", "executor.hidden=null", "executor.moe_ffn=null"),
         "executor.hidden=null executor.moe_ffn=null (expert shape 7168 x 2048): the torch executor needs"),
        (("executor=torch", "executor.max_time_s=-1"), "executor.max_time_s=-1: must be >= 0"),
        (("logger=wandb", "logger.init_timeout_s=-1"), "logger.init_timeout_s=-1: must be > 0"),
        (("logger=wandb", "logger.init_timeout_s=null"), "logger.init_timeout_s=null"),
    ],
)  # fmt: skip
def test_bad_setting_is_refused_before_any_work(overrides, message, tmp_path, no_compute) -> None:
    with pytest.raises(ConfigError) as err:
        run(cfg(*TINY_CELL, *overrides), run_dir=tmp_path / "run")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not (tmp_path / "run").exists()


def test_torch_executor_refuses_a_model_too_large_for_the_host(tmp_path, no_compute, monkeypatch) -> None:
    from relibra.executors import budget

    monkeypatch.setattr(budget, "available_host_bytes", lambda: 8 * 2**30)  # a host with 8 GiB free
    c = cfg(*TINY_CELL, "executor=torch", "executor.hidden=null", "executor.moe_ffn=null")
    with pytest.raises(ConfigError, match=r"needs at least 100\.1 GiB \(4 ranks of 25\.0 GiB.*has 8\.0 GiB"):
        run(c, run_dir=tmp_path / "run")
    validate_ok = cfg(*TINY_CELL, "executor=torch")  # the default small shape fits
    from experiments.config.checks import check_config

    check_config(validate_ok)


def test_torch_executor_refuses_a_run_over_its_time_limit(tmp_path, monkeypatch) -> None:
    from relibra.executors import budget, torch_executor

    monkeypatch.setattr(budget, "matmul_rate", lambda *a: 1.0)  # a host doing 1 FLOP/s: deterministic
    started = []
    monkeypatch.setattr(torch_executor, "launch", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError) as err:
        run(cfg(*TINY_CELL, "executor=torch"), run_dir=tmp_path / "run")
    text = str(err.value)
    assert text.startswith("executor.max_time_s=600: the torch executor run is estimated at ")
    assert "\n" not in text
    assert "raise executor.max_time_s" in text and not started and not (tmp_path / "run").exists()


def test_nccl_without_a_gpu_is_refused(tmp_path, no_compute) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA GPUs: nccl is allowed")
    with pytest.raises(ConfigError, match=r"executor.backend=nccl needs one CUDA GPU per rank \(4\)"):
        run(cfg(*TINY_CELL, "executor=torch", "executor.backend=nccl"), run_dir=tmp_path / "run")


def test_tokens_per_microbatch_zero_is_refused(tmp_path, no_compute) -> None:
    overrides = ["workload.samples_per_microbatch=null", "workload.tokens_per_microbatch=0"]
    with pytest.raises(ConfigError, match=r"workload\.tokens_per_microbatch=0: must be >= 1"):
        run(cfg(*TINY_CELL, *overrides), run_dir=tmp_path)


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
            run(cfg(*TINY_CELL, f"+results_dir={store}"), run_dir=tmp_path / "run")
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
        *TINY_CELL,
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
    first = run(cfg(*TINY_CELL, "planner=megatron", f"+results_dir={store}"), run_dir=tmp_path / "a")
    # the directory held a run of another planner, with its plan dump
    other = tmp_path / "b"
    run(cfg(*TINY_CELL, "planner=eplb", "dump_plans=true"), run_dir=other)
    assert (other / "plans.npz").exists()
    again = run(cfg(*TINY_CELL, "planner=megatron", f"+results_dir={store}"), run_dir=other)
    pd.testing.assert_frame_equal(again, first)
    assert not (other / "plans.npz").exists()  # the old run's plans are not left beside the new results
    summary = json.loads((other / "summary.json").read_text())
    assert summary["files"] == ["per_layer.parquet", "results.parquet", "summary.json"]
    assert summary["rows"][0]["planner"] == "megatron"
    assert summary["not_written"] == {"plans.npz": "dump_plans=false"}
    assert summary["reused_from"].startswith(str(store / "cells"))
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["reused_from"] is None
    stored = ResultsStore(store).read_per_layer(
        cell_key(cfg(*TINY_CELL, "planner=megatron", f"+results_dir={store}"))
    )
    pd.testing.assert_frame_equal(pd.read_parquet(other / "per_layer.parquet"), stored)


def test_reused_cell_with_dump_plans_says_the_plans_were_not_produced(tmp_path) -> None:
    c = cfg(*TINY_CELL, "planner=megatron", "dump_plans=true", f"+results_dir={tmp_path / 'store'}")
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
    overrides = [*TINY_CELL, "logger=wandb", "logger.init_timeout_s=2"]
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
    from experiments.grid.runner import run_grid

    overrides = [*TINY_CELL, "planner=megatron", "trace.preset=reasoning,coding,mixed"]
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
    from experiments.grid.cli import main as reproduce

    (tmp_path / "file").write_text("not a folder")
    code = reproduce(["--results", str(tmp_path / "file"), "--presets", "quick_overhead", "--no-analysis"])
    assert code == 2
    # NOTE: the results root is checked first, before a trace could be converted into it (issue 54)
    assert f"--results={tmp_path / 'file'}: {tmp_path / 'file'} is a file" in capsys.readouterr().err


def test_a_cell_with_an_unreadable_per_layer_table_is_recomputed_restoring_it(tmp_path) -> None:
    """The cell file records its per-layer table (issue 54): a truncated one unfinishes the cell."""
    c = cfg(*TINY_CELL, "planner=megatron", f"+results_dir={tmp_path / 'store'}")
    run(c, run_dir=tmp_path / "a")
    store = ResultsStore(tmp_path / "store")
    with open(store.per_layer_path(cell_key(c)), "r+b") as fh:
        fh.truncate(100)
    run(c, run_dir=tmp_path / "b")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["reused_from"] is None and (tmp_path / "b" / "per_layer.parquet").exists()
    assert store.read_per_layer(cell_key(c)) is not None


# --- round two (issue 32): Hydra's refusals, run directories, sweeps, store, traces, W&B, messages ---------


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("planner=bogus", ["planner=bogus: no such planner option", "megatron"]),
        ("planner=relibrax", ["planner=relibrax", "the closest is relibra"]),
        ("model=olmoe", ["model=olmoe: no such model option", "the closest is olmoe-1b-7b"]),
        ("cluster=hoper", ["cluster=hoper", "the closest is hopper"]),
        ("executor=tourch", ["executor=tourch", "the closest is torch"]),
        ("planner.replica_slot=2", ["planner.replica_slot: unknown key", "planner.replica_slots"]),
        ("cluster.node=2", ["cluster.node: unknown key", "the closest known key is cluster.nodes"]),
        ("+cluster.node=8", ["cluster.node: unknown key", "cluster.nodes"]),
        ("+foo=1", ["foo: unknown key"]),
        ("hydra/launcher=slurmm", ["hydra/launcher=slurmm", "the closest is slurm"]),
    ],
)
def test_cli_refuses_what_hydra_would_refuse_in_one_line_exit_2(override, names, tmp_path) -> None:
    proc = _cli(*TINY_CELL, override, f"hydra.run.dir={tmp_path / 'run'}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert all(name in lines[0] for name in names), lines[0]
    assert not (tmp_path / "run").exists()


def test_cli_refuses_an_unwritable_run_dir(tmp_path) -> None:
    (tmp_path / "file").write_text("not a folder")
    proc = _cli(*TINY_CELL, f"hydra.run.dir={tmp_path / 'file' / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"hydra.run.dir={tmp_path / 'file' / 'run'}" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_refuses_slurm_without_a_controller(tmp_path) -> None:
    from experiments.run import _slurm_problem

    if _slurm_problem("slurm") is None:
        pytest.skip("a Slurm controller answers here")
    proc = _cli("--multirun", *TINY_CELL, "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "hydra/launcher=slurm" in lines[0] and "slurm/start.sh" in lines[0]
    assert (REPO / "slurm" / "start.sh").is_file()


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def test_a_run_that_fails_while_writing_leaves_the_earlier_run_whole(tmp_path, monkeypatch) -> None:
    out = tmp_path / "run"
    run(cfg(*TINY_CELL, "planner=eplb", "dump_plans=true"), run_dir=out)
    before = _snapshot(out)
    real = run_module.compute

    # a value parquet cannot hold, found only at the write (as seed=1e23 was)
    def overflowing(spec):
        results, per_layer, dump = real(spec)
        return results.assign(seed=[10**25]), per_layer, dump

    monkeypatch.setattr(run_module, "compute", overflowing)
    with pytest.raises(Exception, match="int"):
        run(cfg(*TINY_CELL, "planner=megatron"), run_dir=out)
    assert _snapshot(out) == before  # not one file of the new run, not one file of the old one lost
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


def test_a_swapped_cell_is_recomputed_not_returned_as_the_other_planners(tmp_path) -> None:
    store = tmp_path / "store"
    megatron = cfg(*TINY_CELL, "planner=megatron", f"+results_dir={store}")
    first = run(megatron, run_dir=tmp_path / "a")
    run(cfg(*TINY_CELL, "planner=balanced", f"+results_dir={store}"), run_dir=tmp_path / "b")
    cells = ResultsStore(store)
    balanced_key = cell_key(cfg(*TINY_CELL, "planner=balanced", f"+results_dir={store}"))
    cells.cell_path(cell_key(megatron)).write_bytes(cells.cell_path(balanced_key).read_bytes())
    again = run(megatron, run_dir=tmp_path / "c")
    assert again["planner"].tolist() == ["megatron"]
    timed = [c for c in first.columns if c.endswith("_s") and ("plan" in c or "cp_" in c)]  # wall clock
    pd.testing.assert_frame_equal(again.drop(columns=timed), first.drop(columns=timed))
    assert json.loads((tmp_path / "c" / "summary.json").read_text())["reused_from"] is None  # recomputed


def test_a_directory_at_a_cell_path_is_recomputed_and_left_out_of_the_analysis(tmp_path, capsys) -> None:
    from analysis.__main__ import main as analysis

    store = tmp_path / "results" / "quick_overhead"
    c = cfg(*TINY_CELL, "planner=megatron", f"+results_dir={store}")
    ResultsStore(store).cell_path(cell_key(c)).mkdir(parents=True)
    fake = ResultsStore(store).cell_path("0" * 16)
    fake.mkdir()
    run(c, run_dir=tmp_path / "a")  # the directory is a corrupt cell: computed, and stored in its place
    assert ResultsStore(store).cell_path(cell_key(c)).is_file()
    analysis([str(tmp_path / "results"), "--out", str(tmp_path / "analysis")])  # no IsADirectoryError
    assert str(fake) in " ".join(capsys.readouterr().out.split())


def test_sweep_ends_with_every_failed_cell_and_the_path_it_could_not_write(tmp_path) -> None:
    import resource

    # NOTE: as a full disk does, every file beyond 16 KiB fails to be written: the run files (a results
    # table of one tiny cell is about 40 KB), not Hydra's own config files (about 6 KB, more with longer
    # paths: at 6 KiB, Hydra's multirun.yaml under pytest-xdist's temporary paths failed first)
    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))

    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--multirun", *TINY_CELL, "planner=megatron,eplb,balanced",
         f"hydra.sweep.dir={sweep}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=small_files,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "3 cell(s) of the sweep failed:" in proc.stderr, proc.stderr[-3000:]
    summary = proc.stderr[proc.stderr.index("3 cell(s) of the sweep failed:") :]
    for num, planner in enumerate(["megatron", "eplb", "balanced"]):
        assert f"planner={planner}: OSError" in summary, summary
        assert f"cannot write the run file {sweep / str(num) / 'results.parquet'}" in summary, summary
    assert "Traceback" not in proc.stderr
    # the code-version lookup wrote no index under the file-size limit (a killed `git status` left its lock)
    assert not (REPO / ".git" / "index.lock").exists()


def test_sweep_summary_callback_reads_failures_of_cells_run_elsewhere(tmp_path, capsys) -> None:
    from omegaconf import OmegaConf

    from experiments.sweep_check import FAILED_FILE, CheckCells

    (tmp_path / "3").mkdir()
    (tmp_path / "3" / FAILED_FILE).write_text(json.dumps({"cell": "seed=3", "error": "OSError: disk"}))
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit) as stop:
        CheckCells().on_multirun_end(config)
    assert stop.value.code == 1 and "seed=3: OSError: disk" in capsys.readouterr().err
    (tmp_path / "3" / FAILED_FILE).unlink()
    CheckCells().on_multirun_end(config)  # nothing failed: the sweep ends as it is


def test_a_trace_declaring_more_than_its_file_holds_is_refused_before_allocating(
    tmp_path, no_compute
) -> None:
    import io
    import zipfile

    header = {"descr": "<i2", "fortran_order": False, "shape": (10**12, 16, 8)}  # 233 TiB declared
    path = tmp_path / "huge.npz"
    arrays = _trace_arrays()
    with zipfile.ZipFile(path, "w") as archive:
        for name, value in arrays.items():
            buf = io.BytesIO()
            if name == "experts":
                np.lib.format.write_array_header_1_0(buf, header)
                buf.write(b"\0" * 64)
            else:
                np.save(buf, value)
            archive.writestr(f"{name}.npy", buf.getvalue())
    with pytest.raises(ConfigError, match=r"'experts'.*declares shape \(1000000000000, 16, 8\)"):
        run(file_cfg(path), run_dir=tmp_path / "run")


def test_a_trace_with_deeply_nested_or_huge_meta_is_refused(tmp_path, no_compute) -> None:
    for name, meta in (("deep", "[" * 100_000), ("huge", json.dumps({"pad": "x" * (1 << 21)}))):
        arrays = {**_trace_arrays(), "meta": np.array(meta)}
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(ConfigError, match=r"trace array 'meta': is"):
            run(file_cfg(tmp_path / f"{name}.npz"), run_dir=tmp_path / "run")


def test_a_directory_as_trace_path_is_named_and_the_format_doc_exists(tmp_path, no_compute) -> None:
    from relibra.trace.format import FORMAT_DOC

    with pytest.raises(ConfigError, match=rf"trace.path={tmp_path}: is a directory, not a trace file") as err:
        run(file_cfg(tmp_path), run_dir=tmp_path / "run")
    assert FORMAT_DOC in str(err.value) and (REPO / FORMAT_DOC).is_file()
    assert "Routing trace file" in (REPO / FORMAT_DOC).read_text()


def test_a_trace_of_another_model_warns_and_is_recorded(tmp_path, caplog) -> None:
    path = tmp_path / "t.npz"
    np.savez(path, **_trace_arrays())  # meta says model "olmoe"; the run's model is olmoe-1b-7b
    with caplog.at_level("WARNING", logger="experiments.run"):
        results = run(file_cfg(path, "planner=megatron"), run_dir=tmp_path / "run")
    assert "recorded from model olmoe, not the run's model=olmoe-1b-7b" in caplog.text
    assert results["trace_model"].tolist() == ["olmoe"]


def _wandb_cores() -> set[int]:
    found = set()
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"wandb-core" in cmdline.read_bytes():
                found.add(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def test_wandb_wait_is_bounded_and_leaves_no_process(tmp_path, monkeypatch, blackhole) -> None:
    pytest.importorskip("wandb")
    from experiments.tracking.wandb_logger import STEP_ALLOWANCE_S

    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", blackhole)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    before = _wandb_cores()
    c = cfg(*TINY_CELL, "planner=megatron", "logger=wandb", "logger.init_timeout_s=1")
    spec = check_config(c)
    results, per_layer, _ = run_module.compute(spec)
    from experiments.tracking.wandb_logger import log_run

    start = time.monotonic()
    with pytest.warns(RuntimeWarning, match="W&B logging failed"):
        assert not log_run(spec.logger, {}, results, per_layer, str(tmp_path))
    took = time.monotonic() - start
    assert took <= 1 + STEP_ALLOWANCE_S + 2, f"the W&B step took {took:.1f} s"
    deadline = time.monotonic() + 10
    while _wandb_cores() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _wandb_cores() - before, "a wandb-core process outlived the run"


def test_ctrl_c_is_one_line_exit_130_and_removes_the_claim(tmp_path) -> None:
    import signal

    store = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "experiments.run", "model=olmoe-1b-7b", "planner=relibra",
         "trace.num_batches=4", "trace.samples_per_batch=256", f"+results_dir={store}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A suite started in the background (`make test &`, nohup, some CI runners) inherits SIGINT ignored,
        # and Python then never raises KeyboardInterrupt: the run would finish and return 0. A user's Ctrl-C
        # reaches a process with the default disposition, so the child gets that one.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not list((store / "claims").glob("*.lock")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip() and "[HYDRA]" not in line]
    assert proc.returncode == 130, err[-3000:]
    assert len(lines) == 1 and "interrupted; kept" in lines[0], err[-3000:]
    assert not list((store / "claims").glob("*.lock")) and not ResultsStore(store).keys()


def test_reproduce_refuses_an_unknown_preset_without_making_a_folder(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    assert reproduce(["--results", str(tmp_path / "r"), "--presets", "bogus", "--no-analysis"]) == 2
    err = capsys.readouterr().err
    assert "--presets bogus: no such preset" in err and not (tmp_path / "r").exists()


def test_reproduce_refuses_a_bad_override_once_before_the_grid(tmp_path, capsys) -> None:
    from experiments.grid.cli import main as reproduce

    code = reproduce(["--results", str(tmp_path / "r"), "--presets", "quick_overhead", "--no-analysis",
                      *TINY_CELL[:-2], "cluster.nodes=-1"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.count("cluster.nodes=-1: must be >= 1") == 1, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r" / "quick_overhead" / "cells").exists()


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_analysis_of_a_missing_or_empty_store_is_one_line(tmp_path, what) -> None:
    target = tmp_path / "store"
    if what == "empty":
        (target / "cells").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "analysis", str(target)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and str(target) in lines[0], proc.stderr[-3000:]


def test_torch_executor_time_limit_null_disables_the_guard(monkeypatch) -> None:
    from experiments.config.executor_check import executor_time_problem
    from relibra.executors import budget

    monkeypatch.setattr(budget, "matmul_rate", lambda *a: 1.0)
    load = np.full((1, 16, 4, 64), 8, dtype=np.int64)  # 64 experts, top_k 8: 64 tokens per rank
    assert (
        executor_time_problem(
            build_spec(cfg(*TINY_CELL, "executor=torch", "executor.max_time_s=null")), load, 4
        )
        is None
    )
    assert "executor.max_time_s=600" in str(
        executor_time_problem(build_spec(cfg(*TINY_CELL, "executor=torch")), load, 4)
    )
