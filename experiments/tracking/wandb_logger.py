"""Weights & Biases logging for one run: config, metrics row and per-layer table.

Offline by default (``WANDB_MODE=offline`` unless the environment or ``logger.mode`` says otherwise), so it
works with no network. Any W&B failure only warns: the run's local files are written before this is called.
Online, ``logger.init_timeout_s`` bounds how long ``wandb.init`` waits for the server (W&B's own default is
90 s), and the whole W&B step runs in a child process of its own that is stopped, with every process it
started (W&B's ``wandb-core`` service included), once ``init_timeout_s + STEP_ALLOWANCE_S`` have passed:
W&B's own shutdown after a failed init can take longer than the init timeout. Once W&B has failed in a
process, later runs of that process (the cells of a grid) skip it, so a grid without a network loses at
most one bounded wait, and says so once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import warnings
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from experiments.config.spec import LoggerNode

__all__ = ["SETTINGS_KEYS", "STEP_ALLOWANCE_S", "log_run", "logger_problems"]

STEP_ALLOWANCE_S = 10.0
"""Seconds an online W&B step may take beyond ``logger.init_timeout_s``: starting its process (a Python
that imports wandb and pandas: about 3 s on a loaded 2-core host, measured) and finishing a run of one row
and one table."""

_FAILED: list[str] = []
"""Why W&B failed earlier in this process (empty: it has not); later runs then skip it."""


SETTINGS_KEYS = {"project": "project", "entity": "entity", "group": "run_group", "tags": "run_tags"}
"""``logger.<key>`` -> the ``wandb.Settings`` field W&B validates it as (W&B's own rules, e.g. a project
name of at most 128 characters without ``/\\#?%:``, tags of 1 to 64 characters)."""


def logger_problems(logger: LoggerNode) -> list[str]:
    """What W&B would refuse in ``logger.*`` (one problem per key, naming it), checked before any cell is
    computed by W&B's own validation (``wandb.Settings``), so a bad name is not found after the grid."""
    import wandb

    problems: list[str] = []
    values = {"project": logger.project, "entity": logger.entity, "group": logger.group, "tags": logger.tags}
    for key, field in SETTINGS_KEYS.items():
        value = given = values[key]
        if value is None:
            continue
        if key == "tags":
            if not isinstance(value, Sequence) or isinstance(value, str):
                problems.append(f"logger.tags={value!r}: must be a list of strings")
                continue
            value = tuple(value)
        if not (isinstance(value, str) or (key == "tags" and all(isinstance(t, str) for t in value))):
            problems.append(f"logger.{key}={given!r}: must be a string" + (" list" if key == "tags" else ""))
            continue
        try:
            settings: Any = wandb.Settings  # NOTE: one field at a time, so the message names its key
            settings(**{field: value})
        except Exception as exc:  # NOTE: W&B raises UsageError or pydantic's ValidationError
            errors = getattr(exc, "errors", None)  # NOTE: pydantic's list of errors, else W&B's message
            reason = str(errors()[0]["msg"]) if callable(errors) else " ".join(str(exc).split())
            problems.append(f"logger.{key}={given!r}: W&B refuses it ({reason})")
    if logger.project == "":
        problems.append("logger.project='': give a project name (the default is relibra)")
    return problems


def log_run(
    logger: LoggerNode,
    config: dict[str, Any],
    results: pd.DataFrame,
    per_layer: pd.DataFrame | None,
    run_dir: str,
) -> bool:
    """Log one run; returns True when W&B accepted it, False (with one warning per process) on failure."""
    if _FAILED:
        return False
    os.environ.setdefault("WANDB_MODE", logger.mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    timeout = float(logger.init_timeout_s)
    if timeout <= 0:  # NOTE: validate() refuses it first; a caller that skipped it must not hang
        raise ValueError(f"logger.init_timeout_s={timeout}: must be > 0")
    args = (logger, config, results, per_layer, run_dir)
    if os.environ["WANDB_MODE"] in ("offline", "disabled", "dryrun"):
        error = _log(*args)  # NOTE: no server to wait for: in this process, no start-up cost per cell
    else:
        error = _log_bounded(args, timeout + STEP_ALLOWANCE_S)
    if error is None:
        return True
    _FAILED.append(error)
    warnings.warn(
        f"W&B logging failed, local results are intact (in {run_dir}); W&B is skipped for the rest of "
        f"this process: {error}",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def _log(
    logger: LoggerNode,
    config: dict[str, Any],
    results: pd.DataFrame,
    per_layer: pd.DataFrame | None,
    run_dir: str,
) -> str | None:
    """Log one run in this process; None on success, else why it failed (one line)."""
    try:
        import wandb

        row = results.iloc[0].to_dict() if len(results) else {}
        name = "-".join(str(row.get(k, "")) for k in ("planner", "model", "dataset"))
        run = wandb.init(
            project=logger.project,
            entity=logger.entity,
            group=logger.group,
            tags=list(logger.tags),
            name=name or None,
            config=config,
            dir=run_dir,
            reinit=True,
            settings=wandb.Settings(init_timeout=float(logger.init_timeout_s)),
        )
        try:
            for record in results.to_dict(orient="records"):
                run.summary.update({k: v for k, v in record.items() if isinstance(v, int | float | str)})
                run.log({k: v for k, v in record.items() if isinstance(v, int | float)})
            if per_layer is not None and len(per_layer):
                run.log({"per_layer": wandb.Table(dataframe=per_layer)})
        finally:
            run.finish()
        return None
    except Exception as exc:  # NOTE: W&B must never cost the local results; any failure is a warning.
        return repr(exc)


def _child(conn: Connection, args: tuple[Any, ...]) -> None:
    """The online W&B step in its own process (:func:`_log_bounded`): logs, stops W&B's service, reports."""
    error = _log(*args)
    try:
        import wandb

        wandb.teardown()  # NOTE: stops wandb-core now, rather than when it notices this process is gone
    except Exception as exc:  # NOTE: the run is logged or not already; teardown only tidies up
        error = error or f"W&B teardown failed: {exc!r}"
    conn.send(error)
    conn.close()


def _log_bounded(args: tuple[Any, ...], bound_s: float) -> str | None:
    """:func:`_log` in a child process given ``bound_s`` seconds in all; then the child and every process
    it started are killed if still there. None on success, else why it failed."""
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, args), daemon=True)
    child.start()
    send.close()
    error: str | None = (
        f"W&B did not finish within {bound_s:g} s (logger.init_timeout_s + {STEP_ALLOWANCE_S:g})"
    )
    try:
        if receive.poll(bound_s):
            error = receive.recv()
    except (EOFError, OSError):
        error = f"the W&B process ended without a report (exit status {child.exitcode})"
    finally:
        for pid in [*_descendants(child.pid), *([child.pid] if child.pid is not None else [])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
        child.join(timeout=5)
        receive.close()
    return error


def _descendants(pid: int | None) -> list[int]:
    """Every living process below ``pid`` (children first), from ``/proc``; empty where there is none."""
    if pid is None:
        return []
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found: list[int] = []
    todo = [pid]
    while todo:
        for kid in parents.get(todo.pop(), []):
            found.append(kid)
            todo.append(kid)
    return found
