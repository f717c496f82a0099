"""The results store as a run and the analysis use it: :func:`run_cell` (read a finished cell back or
compute and store it, once however many writers reach it), :func:`load_experiment` and
:func:`load_per_layer` (an experiment's finished cells), :func:`stored_code_version` (which code computed a
cell). The store itself: :mod:`experiments.store.results_store`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore

__all__ = ["UNKNOWN_CODE", "load_experiment", "load_per_layer", "run_cell", "stored_code_version"]


UNKNOWN_CODE = "unknown"
"""``code_version`` of a cell stored without one (by code older than the column)."""


def stored_code_version(results: pd.DataFrame) -> str:
    """The ``code_version`` a cell's result rows were computed by (:data:`UNKNOWN_CODE` if not recorded)."""
    if "code_version" not in results.columns or results.empty:
        return UNKNOWN_CODE
    versions = sorted(set(results["code_version"].astype(str)))
    return versions[0] if len(versions) == 1 else ",".join(versions)


def run_cell(
    store: ResultsStore,
    config: Any,
    compute: Callable[[], tuple[pd.DataFrame, pd.DataFrame | None]],
    recompute: bool = False,
) -> tuple[pd.DataFrame, bool]:
    """Results of the cell ``config``: read back when finished, else ``compute()``-d and stored.

    ``compute`` returns ``(results, per_layer or None)``. Returns ``(results, reused)`` where ``reused`` says
    the cell was already finished and nothing ran. ``recompute``: compute even a finished cell; its stored
    rows are replaced only once the new ones are written (atomically). A cell whose file is unreadable
    counts as missing. The cell is computed under :meth:`ResultsStore.claim`, and looked up again once
    the claim is held, so two sweeps of one grid compute each cell once.
    """
    key = cell_key(config)
    store.clean_stale()
    if not recompute and (rows := store.finished(key)) is not None:
        return rows, True
    with store.claim(key):
        if not recompute and (rows := store.finished(key)) is not None:
            return rows, True  # another writer finished it while this one waited for the claim
        results, per_layer = compute()
        store.write(key, results, config, per_layer)
    return results, False


def load_experiment(results_dir: str | Path, all_cells: bool = False) -> pd.DataFrame:
    """One experiment's finished cells as a frame (one row per planner run, plus a ``cell`` column).

    Only the cells of its current grid when the experiment has a ``grid.json``, unless ``all_cells``.
    """
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results directory {root} does not exist (run the experiment first)")
    return ResultsStore(root).load(all_cells)


def load_per_layer(results_dir: str | Path) -> pd.DataFrame:
    """One experiment's per-layer tables (empty frame with a ``cell`` column when there are none)."""
    return ResultsStore(Path(results_dir)).load_per_layer()
