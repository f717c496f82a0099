"""Helpers of the Slurm integration tests (tests/experiments/test_slurm.py): the test cluster, sweep commands,
polling.

The cluster is the real single-node Slurm of ``slurm/start.sh`` (munged, MariaDB, slurmdbd, slurmctld,
slurmd), in its own state directory and on its own ports so that it never meets a cluster a user started
with the default settings. :class:`PauseOnce` is a Hydra callback that makes one cell of a sweep wait, the
first time only, so a test can kill or preempt that cell while its Python process runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

REPO = Path(__file__).resolve().parents[1]
SLURM_SCRIPTS = REPO / "slurm"
CANNOT_RUN_HERE = 3
"""Exit status of slurm/start.sh where Slurm cannot be installed or run (not root, no apt-get, offline)."""

T = TypeVar("T")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or run on this machine (the tests skip with this message)."""


@dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster.

    state_dir: where start.sh keeps configs, logs, the database and the daemons' PIDs.
    env: the process environment for Slurm clients and sweeps (``SLURM_CONF`` set, repo on PYTHONPATH).
    """

    state_dir: Path
    env: dict[str, str]

    def client(self, *args: str, timeout_s: float = 30.0) -> str:
        """Run a Slurm client command (sacct, squeue, scancel, scontrol) and return its stdout."""
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def states(self, job_id: str, *, duplicates: bool = False) -> list[tuple[str, str]]:
        """(job id, state) of every allocation of ``job_id`` (an array: one per task) from sacct.

        ``duplicates``: also the earlier runs of requeued jobs (state ``REQUEUED``).
        """
        args = ["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,State"]
        if duplicates:
            args.append("--duplicates")
        rows = [line.split("|") for line in self.client(*args).splitlines() if line.strip()]
        return [(row[0], row[1].split()[0]) for row in rows]

    def log_tail(self, lines: int = 40) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for log in sorted((self.state_dir / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)


def _script(name: str, state_dir: Path, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SLURM_SCRIPTS / name)],
        env={**env, "RELIBRA_SLURM_DIR": str(state_dir)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def start_cluster(state_dir: Path, port: int, timeout_s: float = 600.0) -> SlurmCluster:
    """Start (installing Slurm when missing) the test cluster; raises :class:`SlurmUnavailable` where it
    cannot run, RuntimeError when it fails to start."""
    env = {**os.environ, "RELIBRA_SLURM_PORT": str(port)}
    done = _script("start.sh", state_dir, env, timeout_s)
    if done.returncode == CANNOT_RUN_HERE:
        raise SlurmUnavailable(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no reason")
    if done.returncode != 0:
        raise RuntimeError(f"slurm/start.sh exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    pythonpath = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(SLURM_CONF=str(state_dir / "etc" / "slurm.conf"), PYTHONPATH=pythonpath)
    return SlurmCluster(state_dir=state_dir, env=env)


def stop_cluster(state_dir: Path) -> str:
    """Stop every daemon of the test cluster by its recorded PID; returns the script's output."""
    done = _script("stop.sh", state_dir, dict(os.environ), timeout_s=120.0)
    return done.stdout + done.stderr


def wait_until(check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.5) -> T:
    """Poll ``check`` until it returns something other than None/False; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def sweep_command(overrides: Sequence[str]) -> list[str]:
    """``python -m experiments.run --multirun`` with ``overrides`` (run from the repository root)."""
    return [sys.executable, "-m", "experiments.run", "--multirun", *overrides]


def pause_overrides(
    marker: Path, job_num: int, seconds: float, starts: int = 1, name: str = "pause_once"
) -> list[str]:
    """Hydra overrides that install :class:`PauseOnce` for cell ``job_num`` of a sweep (``name``: the
    callback's key, so that several cells can pause)."""
    prefix = f"+hydra.callbacks.{name}"
    return [
        f"{prefix}._target_={PauseOnce.__module__}.PauseOnce",
        f"{prefix}.marker={marker}",
        f"{prefix}.job_num={job_num}",
        f"{prefix}.seconds={seconds}",
        f"{prefix}.starts={starts}",
    ]


def read_marker(marker: Path) -> dict[str, Any] | None:
    """What :class:`PauseOnce` wrote when it last began to wait (None before that)."""
    try:
        return json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _slurm_job_id() -> str | None:
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")


class PauseOnce(Callback):
    """Hydra callback: cell ``job_num`` of a sweep sleeps ``seconds`` when it starts computing, on its
    first ``starts`` starts (default once).

    The sleep happens inside the cell's computation (the synthetic generator, wrapped in the cell's own
    process), so a signal that arrives meanwhile (a preemption, a time-out) interrupts the task itself, as
    it would interrupt a long cell. NOTE: not in ``on_job_start`` itself: Hydra turns an exception raised
    by a callback into a warning, which would hide the one submitit raises when it gives up. The wrapped
    function is ``relibra.trace.synthetic.generate_counts`` because ``experiments.config.build.load_counts``
    imports it when called; the task function itself comes pickled by value from the sweep's ``__main__``, so
    patching ``experiments.run`` in the worker would not reach it.
    Each pausing start writes ``marker`` (JSON: its PID, Slurm job id ``ARRAY_TASK`` and how many starts
    have paused); later starts (a rerun, a requeue) run at once. Test-only: it is installed with
    ``+hydra.callbacks.<name>._target_=...`` overrides.
    """

    def __init__(self, marker: str, job_num: int, seconds: float, starts: int = 1) -> None:
        self.marker = Path(marker)
        self.job_num = int(job_num)
        self.seconds = float(seconds)
        self.starts = int(starts)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if int(config.hydra.job.num) != self.job_num:
            return
        paused = (read_marker(self.marker) or {}).get("starts", 0)
        if paused >= self.starts:
            return
        import relibra.trace.synthetic as synthetic

        generate = synthetic.generate_counts

        def paused_generate(*args: Any, **kwargs: Any) -> Any:
            tmp = self.marker.with_suffix(".tmp")
            tmp.write_text(
                json.dumps({"pid": os.getpid(), "slurm_job_id": _slurm_job_id(), "starts": paused + 1})
            )
            tmp.replace(self.marker)
            time.sleep(self.seconds)
            return generate(*args, **kwargs)

        synthetic.generate_counts = paused_generate  # type: ignore[assignment]


def rendezvous_overrides(folder: Path, parties: int, timeout_s: float) -> list[str]:
    """Hydra overrides that install :class:`Rendezvous`."""
    prefix = "+hydra.callbacks.rendezvous"
    return [
        f"{prefix}._target_={Rendezvous.__module__}.Rendezvous",
        f"{prefix}.folder={folder}",
        f"{prefix}.parties={parties}",
        f"{prefix}.timeout_s={timeout_s}",
    ]


class Rendezvous(Callback):
    """Hydra callback: a cell waits until ``parties`` cells with its job number (one per concurrent sweep
    of the same grid) have started, or ``timeout_s``, so that the sweeps reach each cell at once.

    Each start leaves ``folder/<job num>.<pid>``. Test-only, like :class:`PauseOnce`.
    """

    def __init__(self, folder: str, parties: int, timeout_s: float) -> None:
        self.folder = Path(folder)
        self.parties = int(parties)
        self.timeout_s = float(timeout_s)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        num = int(config.hydra.job.num)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{num}.{os.getpid()}").touch()
        deadline = time.monotonic() + self.timeout_s
        while len(list(self.folder.glob(f"{num}.*"))) < self.parties and time.monotonic() < deadline:
            time.sleep(0.2)
