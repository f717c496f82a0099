"""Weights & Biases logging for one run: config, metrics row and per-layer table.

Offline by default (``WANDB_MODE=offline`` unless the environment or ``logger.mode`` says otherwise), so it
works with no network. Any W&B failure only warns: the run's local files are written before this is called.
Online, ``logger.init_timeout_s`` bounds how long a run waits for the server (W&B's own default is 90 s);
once W&B has failed in a process, later runs of that process (the cells of a grid) skip it, so a grid
without a network loses at most one timeout, and says so once.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pandas as pd

__all__ = ["log_run"]

_FAILED: list[str] = []
"""Why W&B failed earlier in this process (empty: it has not); later runs then skip it."""


def log_run(
    logger_cfg: dict[str, Any],
    config: dict[str, Any],
    results: pd.DataFrame,
    per_layer: pd.DataFrame | None,
    run_dir: str,
) -> bool:
    """Log one run; returns True when W&B accepted it, False (with one warning per process) on failure."""
    if _FAILED:
        return False
    try:
        import wandb

        os.environ.setdefault("WANDB_MODE", str(logger_cfg.get("mode") or "offline"))
        os.environ.setdefault("WANDB_SILENT", "true")
        row = results.iloc[0].to_dict() if len(results) else {}
        name = "-".join(str(row.get(k, "")) for k in ("planner", "model", "dataset"))
        run = wandb.init(
            project=logger_cfg.get("project") or "relibra",
            entity=logger_cfg.get("entity"),
            group=logger_cfg.get("group"),
            tags=list(logger_cfg.get("tags") or []),
            name=name or None,
            config=config,
            dir=run_dir,
            reinit=True,
            settings=wandb.Settings(init_timeout=float(logger_cfg["init_timeout_s"])),
        )
        try:
            for record in results.to_dict(orient="records"):
                run.summary.update({k: v for k, v in record.items() if isinstance(v, int | float | str)})
                run.log({k: v for k, v in record.items() if isinstance(v, int | float)})
            if per_layer is not None and len(per_layer):
                run.log({"per_layer": wandb.Table(dataframe=per_layer)})
        finally:
            run.finish()
        return True
    except Exception as exc:  # NOTE: W&B must never cost the local results; any failure is a warning.
        _FAILED.append(repr(exc))
        warnings.warn(
            f"W&B logging failed, local results are intact (in {run_dir}); W&B is skipped for the rest of "
            f"this process: {exc!r}",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
