"""Integration tests against a real single-node Slurm cluster (slurm/start.sh), through Hydra's submitit
launcher (``hydra/launcher=slurm``):

1. a 2 planners x 2 datasets grid: every cell's result arrives and equals the same cell run locally;
2. a fault: one array task is cancelled mid-run; the sweep fails instead of hanging, and rerunning the
   same command computes only the missing cell (the results store keeps the others untouched);
3. preemption: a task receiving Slurm's preemption signal checkpoints through submitit, is requeued and
   finishes;
4. time-outs: Slurm's time limit signals a task, submitit requeues it at most ``max_num_timeout`` times,
   then the sweep fails; the rerun computes only what is missing;
5. a task killed as the out-of-memory killer kills (SIGKILL) fails the sweep, and the rerun completes it;
6. two sweeps of one grid into one store at once: no lost or duplicated rows, each cell computed once
   (the store's claim), the other sweep reading it back.

The module starts the cluster (installing Slurm with apt-get when missing, as root) and stops it when the
module ends, whether the tests pass or not. The tests skip only where Slurm cannot be installed or run.
Concurrent test sessions on one machine take turns through a file lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from experiments.store.keys import wall_clock_column
from tests.slurm_helpers import (
    REPO,
    SlurmCluster,
    SlurmUnavailable,
    pause_overrides,
    read_marker,
    rendezvous_overrides,
    start_cluster,
    stop_cluster,
    sweep_command,
    wait_until,
)

pytestmark = pytest.mark.slurm

STATE_DIR = Path(os.environ.get("RELIBRA_SLURM_TEST_DIR", "/tmp/relibra-slurm-test"))
PORT = int(os.environ.get("RELIBRA_SLURM_TEST_PORT", "6917"))
SWEEP_TIMEOUT_S = 240.0

# One tiny cell: seconds of CPU each. NOTE: planner=relibra is left out of the grid because a fresh
# checkout compiles its numba kernels in every new process (about a minute on 2 cores).
CELL = [
    "model=olmoe-1b-7b",
    "trace.num_batches=1",
    "trace.samples_per_batch=16",
    "cluster.nodes=1",
    "cluster.gpus_per_node=4",
]
GRID = ["planner=megatron,eplb", "trace.preset=reasoning,coding"]
LAUNCHER = [
    "hydra/launcher=slurm",
    "hydra.launcher.cpus_per_task=1",
    "hydra.launcher.mem_gb=1",
    "hydra.launcher.timeout_min=60",
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    lock_path = STATE_DIR.with_name(STATE_DIR.name + ".lock")
    with open(lock_path, "w") as lock:
        # NOTE: one test cluster per machine; another session waits here until this module is done.
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                running = start_cluster(STATE_DIR, PORT)
            except SlurmUnavailable as exc:
                pytest.skip(f"Slurm cannot be installed or run on this machine: {exc}")
            # Never let a surrounding Slurm job's variables leak into the sweeps.
            for key in [k for k in running.env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
                del running.env[key]
            yield running
        finally:
            stop_cluster(STATE_DIR)
            fcntl.flock(lock, fcntl.LOCK_UN)


def _sweep(cluster: SlurmCluster, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        sweep_command(overrides),
        cwd=REPO,
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, cluster: SlurmCluster, timeout_s: float = SWEEP_TIMEOUT_S) -> str:
    """Wait for a sweep; returns its stderr+stdout. A hang is a failure (the sweep is killed)."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"sweep still running after {timeout_s:.0f} s\n{err[-3000:]}\n{cluster.log_tail()}")
    return err + out


def _local_result(overrides: list[str], run_dir: Path) -> pd.DataFrame:
    """The same cell run in this process, without Slurm."""
    from experiments.run import run

    with initialize_config_dir(str(REPO / "experiments" / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    return run(cfg, run_dir=run_dir)


def _assert_same_result(remote: pd.DataFrame, local: pd.DataFrame) -> None:
    columns = [c for c in local.columns if not wall_clock_column(c)]
    assert set(remote.columns) == set(local.columns)
    pd.testing.assert_frame_equal(
        remote[columns].reset_index(drop=True), local[columns].reset_index(drop=True), check_exact=False
    )


def _array_job_id(sweep_dir: Path) -> str:
    """The Slurm array job id of a sweep, from submitit's folder ``.submitit/<array id>_<task>``."""
    ids = {
        p.name.split("_")[0] for p in (sweep_dir / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)
    }
    assert len(ids) == 1, f"expected one array job in {sweep_dir}, found {sorted(ids)}"
    return ids.pop()


def test_grid_results_match_local_runs(cluster: SlurmCluster, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = _sweep(cluster, [*LAUNCHER, *CELL, *GRID, f"hydra.sweep.dir={sweep_dir}"])
    output = _finish(proc, cluster)
    assert proc.returncode == 0, output[-3000:]

    # Every cell ran as one task of a single Slurm array job.
    job = _array_job_id(sweep_dir)
    expected = [f"{job}_{i}" for i in range(4)]

    # NOTE: slurmctld sends job records to slurmdbd asynchronously; right after the sweep returns, sacct
    # may still show the array as one record ('<job>') before the per-task records ('<job>_<i>') arrive.
    # Their end states may also arrive a moment after the sweep has read every result.
    def per_task() -> dict[str, str] | None:
        states = dict(cluster.states(job))
        ended = not {"PENDING", "RUNNING"} & set(states.values())
        return states if sorted(states) == expected and ended else None

    try:
        states = wait_until(per_task, 30, f"per-task accounting records of array job {job}")
    except TimeoutError:
        states = dict(cluster.states(job))
    assert sorted(states) == expected, states
    assert set(states.values()) == {"COMPLETED"}, states

    seen = set()
    for num in range(4):
        remote = pd.read_parquet(sweep_dir / str(num) / "results.parquet")
        assert len(remote) == 1
        planner, dataset = remote.loc[0, "planner"], remote.loc[0, "dataset"]
        seen.add((planner, dataset))
        local = _local_result(
            [*CELL, f"planner={planner}", f"trace.preset={dataset}"], tmp_path / f"local{num}"
        )
        _assert_same_result(remote, local)
    assert seen == {(p, d) for p in ("megatron", "eplb") for d in ("reasoning", "coding")}


@pytest.mark.slow
def test_killed_task_fails_the_sweep_and_rerun_completes_only_missing_cells(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    sweep_dir, store = tmp_path / "sweep", tmp_path / "store"
    marker = tmp_path / "paused.json"
    command = [
        *LAUNCHER,
        *CELL,
        *GRID,
        f"hydra.sweep.dir={sweep_dir}",
        f"+results_dir={store}",
        *pause_overrides(marker, job_num=1, seconds=600),
    ]
    cells = store / "cells"

    def finished() -> list[Path]:
        return sorted(cells.glob("[!.]*.parquet")) if cells.is_dir() else []

    proc = _sweep(cluster, command)
    try:
        paused = wait_until(lambda: read_marker(marker), 120, "cell 1 to start")
        wait_until(lambda: len(finished()) == 3 or None, 120, "the three other cells to finish")
        cluster.client("scancel", paused["slurm_job_id"])
        output = _finish(proc, cluster, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "a sweep with a cancelled task must fail"
    assert "CANCELLED" in output, output[-3000:]
    cancelled = paused["slurm_job_id"]

    def accounted() -> bool:  # the cancellation reaches slurmdbd asynchronously
        return dict(cluster.states(cancelled)).get(cancelled) not in {None, "PENDING", "RUNNING"}

    wait_until(accounted, 60, f"the accounting of job {cancelled} to record its end")
    assert dict(cluster.states(cancelled)) == {cancelled: "CANCELLED"}

    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished()}
    rerun = _sweep(cluster, command)
    output = _finish(rerun, cluster)
    assert rerun.returncode == 0, output[-3000:]

    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in finished()}
    assert len(after) == 4
    # The three finished cells were read back, not computed and written again; one new cell appeared.
    assert {k: after[k] for k in before} == before
    rows = pd.concat([pd.read_parquet(p) for p in finished()], ignore_index=True)
    assert sorted(zip(rows.planner, rows.dataset)) == sorted(
        (p, d) for p in ("megatron", "eplb") for d in ("reasoning", "coding")
    )
    for num in range(4):  # every run directory of the rerun holds its cell's row
        assert len(pd.read_parquet(sweep_dir / str(num) / "results.parquet")) == 1


@pytest.mark.slow
def test_preempted_task_checkpoints_requeues_and_finishes(cluster: SlurmCluster, tmp_path: Path) -> None:
    sweep_dir, store = tmp_path / "sweep", tmp_path / "store"
    marker = tmp_path / "paused.json"
    cell = [*CELL, "planner=megatron", "trace.preset=reasoning"]
    proc = _sweep(
        cluster,
        [
            *LAUNCHER,
            *cell,
            f"hydra.sweep.dir={sweep_dir}",
            f"+results_dir={store}",
            *pause_overrides(marker, job_num=0, seconds=600),
        ],
    )
    try:
        paused = wait_until(lambda: read_marker(marker), 120, "the cell to start")
        job = paused["slurm_job_id"]
        # The signal submitit's sbatch script asks Slurm to send before a job is stopped (--signal=USR2@N).
        cluster.client("scancel", "--signal=USR2", job)

        def requeued() -> bool:
            return any(state == "REQUEUED" for _, state in cluster.states(job, duplicates=True))

        # The requeued job starts again after the test cluster's credential lifetime (cred_expire, 10 s).
        wait_until(requeued, 60, f"job {job} to be requeued")
        output = _finish(proc, cluster)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]

    def accounted() -> bool:  # slurmdbd records the end a moment after submitit has read the result
        return [state for _, state in cluster.states(job, duplicates=True)][-1:] != ["RUNNING"]

    wait_until(accounted, 60, f"the accounting of job {job} to record its end")
    assert [state for _, state in cluster.states(job, duplicates=True)] == ["REQUEUED", "COMPLETED"]
    logs = "\n".join(p.read_text() for p in (sweep_dir / ".submitit").rglob("*_log.*"))
    assert "Calling checkpoint method" in logs, logs[-3000:]
    assert re.search(rf"Requeued job {re.escape(job)}", logs), logs[-3000:]

    remote = pd.read_parquet(sweep_dir / "0" / "results.parquet")
    assert len(list((store / "cells").glob("[!.]*.parquet"))) == 1
    _assert_same_result(remote, _local_result(cell, tmp_path / "local"))


def test_sim_grid_sbatch_template_runs_every_cell(cluster: SlurmCluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    env = {**cluster.env, "RELIBRA_PYTHON": sys.executable}
    submitted = subprocess.run(
        [
            "bash",
            str(REPO / "slurm" / "sim_grid.sbatch"),
            "quick_datasets",
            *CELL,
            *GRID,
            f"results_dir={store}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    job = re.search(r"Submitted batch job (\d+)", submitted.stdout)
    assert job, submitted.stdout

    def done() -> dict[str, str] | None:
        states = dict(cluster.states(job.group(1)))
        finished = len(states) == 4 and all(s not in {"PENDING", "RUNNING"} for s in states.values())
        return states if finished else None

    states = wait_until(done, SWEEP_TIMEOUT_S, f"array job {job.group(1)} to finish")
    assert set(states.values()) == {"COMPLETED"}, states
    rows = pd.concat([pd.read_parquet(p) for p in (store / "cells").glob("[!.]*.parquet")])
    assert sorted(zip(rows.planner, rows.dataset)) == sorted(
        (p, d) for p in ("megatron", "eplb") for d in ("reasoning", "coding")
    )


# --- time-outs, the out-of-memory killer, concurrent sweeps into one store ------------------------------


def _launcher(**settings: object) -> list[str]:
    """LAUNCHER with some of its settings replaced (Hydra refuses two overrides of one key)."""
    base = {"cpus_per_task": 1, "mem_gb": 1, "timeout_min": 60, **settings}
    return ["hydra/launcher=slurm", *(f"hydra.launcher.{k}={v}" for k, v in base.items())]


def _history(cluster: SlurmCluster, job: str) -> list[str]:
    return [state for _, state in cluster.states(job, duplicates=True)]


def _cells(store: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (store / "cells").glob("[!.]*.parquet")}


@pytest.mark.slow
def test_timed_out_task_is_requeued_at_most_max_num_timeout_times(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    sweep_dir, store = tmp_path / "sweep", tmp_path / "store"
    once, always = tmp_path / "once.json", tmp_path / "always.json"
    base = [*CELL, "planner=megatron", "trace.preset=reasoning,coding", f"+results_dir={store}"]
    # Slurm's own time limit (1 minute) sends USR2 signal_delay_s before it; submitit counts that as a
    # time-out (it ran past its guaranteed share of the limit) and requeues while max_num_timeout allows.
    # NOTE: slurmctld checks time limits every 30 s, so a 30 s warning arrives 30-60 s into the task, after
    # its Python process has installed submitit's handler (an earlier one would kill it outright).
    proc = _sweep(
        cluster,
        [
            *_launcher(timeout_min=1, signal_delay_s=30, max_num_timeout=1),
            *base,
            f"hydra.sweep.dir={sweep_dir}",
            *pause_overrides(once, job_num=0, seconds=600, starts=1, name="pause_first"),
            *pause_overrides(always, job_num=1, seconds=600, starts=99, name="pause_always"),
        ],
    )
    try:
        output = _finish(proc, cluster, timeout_s=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "a task that timed out more than max_num_timeout times must fail the sweep"
    assert "timed-out too many times" in output, output[-3000:]  # submitit gave up, the sweep says why
    first, second = read_marker(once)["slurm_job_id"], read_marker(always)["slurm_job_id"]

    def accounted() -> bool:
        return all(
            _history(cluster, job)[-1:] not in (["RUNNING"], ["PENDING"], []) for job in (first, second)
        )

    wait_until(accounted, 60, "the accounting of both tasks to record their ends")
    assert _history(cluster, first) == ["REQUEUED", "COMPLETED"]  # timed out once, requeued, finished
    # NOTE: one requeue, then submitit gave up. Slurm records the last allocation as COMPLETED: Hydra's
    # run_job catches submitit's UncompletedJobError and hands it back as the job's (failed) result, which
    # the sweep then raises; the sweep's failure, not the accounting, is what says the cell did not finish.
    assert _history(cluster, second).count("REQUEUED") == 1, _history(cluster, second)
    assert read_marker(always)["starts"] == 2
    logs = "\n".join(p.read_text() for p in (sweep_dir / ".submitit").rglob("*_log.*"))
    assert "this job is timed-out" in logs, logs[-3000:]

    done = _cells(store)
    assert len(done) == 1  # only the cell that finished after its requeue; nothing partial
    assert not list((store / "cells").glob(".tmp-*"))
    rerun = _sweep(cluster, [*LAUNCHER, *base, f"hydra.sweep.dir={tmp_path / 'rerun'}"])
    output = _finish(rerun, cluster)
    assert rerun.returncode == 0, output[-3000:]
    after = _cells(store)
    assert len(after) == 2 and {k: after[k] for k in done} == done


@pytest.mark.slow
def test_task_killed_by_the_oom_killer_fails_the_sweep_and_rerun_completes_it(
    cluster: SlurmCluster, tmp_path: Path
) -> None:
    sweep_dir, store, marker = tmp_path / "sweep", tmp_path / "store", tmp_path / "paused.json"
    base = [*LAUNCHER, *CELL, "planner=megatron", "trace.preset=reasoning,coding", f"+results_dir={store}"]
    proc = _sweep(cluster, [*base, f"hydra.sweep.dir={sweep_dir}", *pause_overrides(marker, 1, 600)])
    try:
        paused = wait_until(lambda: read_marker(marker), 120, "cell 1 to start")
        wait_until(lambda: len(_cells(store)) == 1 or None, 120, "cell 0 to finish")
        # NOTE: what the kernel's OOM killer does to the biggest process of a task: SIGKILL, no clean-up.
        # The test cluster runs without cgroup memory enforcement (no writable cgroup tree in containers),
        # so the test sends that signal itself.
        os.kill(int(paused["pid"]), signal.SIGKILL)
        output = _finish(proc, cluster, timeout_s=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, "a sweep with a killed task must fail, not hang"
    assert paused["slurm_job_id"] in output, output[-3000:]
    wait_until(
        lambda: _history(cluster, paused["slurm_job_id"])[-1:] not in (["RUNNING"], ["PENDING"], []),
        60,
        "the accounting of the killed task",
    )
    assert _history(cluster, paused["slurm_job_id"])[-1] in {"FAILED", "OUT_OF_MEMORY"}
    done = _cells(store)
    rerun = _sweep(cluster, [*base, f"hydra.sweep.dir={sweep_dir}"])
    output = _finish(rerun, cluster)
    assert rerun.returncode == 0, output[-3000:]
    after = _cells(store)
    assert len(after) == 2 and {k: after[k] for k in done} == done
    assert not list((store / "cells").glob(".tmp-*"))


def test_two_sweeps_into_one_store_compute_each_cell_once(cluster: SlurmCluster, tmp_path: Path) -> None:
    store = tmp_path / "store"
    sweeps = [tmp_path / "sweep_a", tmp_path / "sweep_b"]
    # Both sweeps run two tasks at a time, in the same order, and each task waits for its twin in the other
    # sweep, so the two reach every cell together and the claim decides who computes it.
    common = [
        *_launcher(array_parallelism=2),
        *CELL,
        *GRID,
        f"+results_dir={store}",
        *rendezvous_overrides(tmp_path / "rendezvous", parties=2, timeout_s=90),
    ]
    procs = [_sweep(cluster, [*common, f"hydra.sweep.dir={sweep}"]) for sweep in sweeps]
    try:
        outputs = [_finish(proc, cluster, timeout_s=SWEEP_TIMEOUT_S + 120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    cells = sorted((store / "cells").glob("[!.]*.parquet"))
    rows = pd.concat([pd.read_parquet(p) for p in cells], ignore_index=True)
    assert len(cells) == 4 and len(rows) == 4  # no lost and no duplicated rows
    assert sorted(zip(rows.planner, rows.dataset)) == sorted(
        (p, d) for p in ("megatron", "eplb") for d in ("reasoning", "coding")
    )
    for num in range(4):
        summaries = [json.loads((sweep / str(num) / "summary.json").read_text()) for sweep in sweeps]
        computed = [s["reused_from"] is None for s in summaries]
        assert sorted(computed) == [False, True], f"cell {num}: computed by {computed.count(True)} sweeps"
        assert summaries[0]["rows"] == summaries[1]["rows"]
