"""Load every experiment under a results root (``results/<experiment>/``) written by ``experiments.store``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.store.access import UNKNOWN_CODE
from experiments.store.cell_files import CorruptCellError, GridFileError
from experiments.store.results_store import ResultsStore
from relibra.cluster import ModelSpec

__all__ = [
    "Results",
    "code_versions",
    "experiment_dirs",
    "experiment_name",
    "grid_problems",
    "load_per_layer_results",
    "load_results",
    "param_bytes_per_gpu",
    "read_per_layer_results",
    "read_results",
]

BYTES_PER_PARAM = 2.0
"""bf16 weights."""


def param_bytes_per_gpu(model: Mapping[str, Any], ep_size: int) -> float:
    """bf16 bytes of the parameters one GPU holds under expert parallelism alone (no TP, no PP).

    Its ``E / G`` experts of every MoE layer, plus every dense part replicated: attention, shared experts,
    dense FFN layers, input and output embeddings. The paper's per-GPU figure also reflects its tensor and
    pipeline parallel split, which the results do not record, so this is an upper bound on it.
    """
    hidden, layers, moe_layers = int(model["hidden"]), int(model["num_layers"]), int(model["num_moe_layers"])
    attention = ModelSpec(**dict(model)).attention_params
    experts = moe_layers * (int(model["num_experts"]) // ep_size) * 3 * hidden * int(model["moe_ffn"])
    shared = moe_layers * int(model.get("shared_experts", 0)) * 3 * hidden * int(model.get("shared_ffn", 0))
    dense = (layers - moe_layers) * 3 * hidden * int(model.get("dense_ffn", 0))
    embeddings = 2 * int(model.get("vocab", 0)) * hidden
    return BYTES_PER_PARAM * (experts + shared + dense + layers * attention + embeddings)


def experiment_name(directory: Path) -> str:
    """The experiment a store holds: its cells' ``experiment_name`` (set by every preset), else the
    folder's name. So a store copied to a folder of another name still gets its preset's tables."""
    store = ResultsStore(directory)
    try:
        keys = store.current_keys()
    except GridFileError:  # NOTE: only to name the store; read_results refuses it, naming the file
        keys = store.keys()
    for key in keys:
        try:
            name = store.config(key).get("experiment_name")
        except (CorruptCellError, FileNotFoundError, KeyError, ValueError):
            continue
        if name and PLAIN_NAME.fullmatch(str(name)):  # NOTE: a name becomes file names in --out
            return str(name)
    return directory.name


PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""An ``experiment_name`` that may name output files (no path separator, no leading dot); a store whose
cells hold another is named by its folder instead."""


def grid_problems(root: str | Path) -> list[str]:
    """One line per store under ``root`` whose ``grid.json`` is damaged (:class:`~experiments.store.
    GridFileError`), naming the file."""
    out = []
    for directory in experiment_dirs(root).values():
        try:
            ResultsStore(directory).grid_keys()
        except GridFileError as err:
            out.append(str(err))
    return out


def experiment_dirs(root: str | Path) -> dict[str, Path]:
    """``{experiment name: directory}`` for every store under ``root`` (``root`` itself may be one)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results directory {root} does not exist (run an experiment first)")
    if (root / "cells").is_dir():
        return {experiment_name(root): root}
    return {experiment_name(p): p for p in sorted(root.iterdir()) if (p / "cells").is_dir()}


def code_versions(frame: pd.DataFrame) -> dict[str, int]:
    """``{code_version: rows}`` of a results frame (:data:`~experiments.store.access.UNKNOWN_CODE` where
    absent)."""
    if "code_version" not in frame:
        return {UNKNOWN_CODE: len(frame)} if len(frame) else {}
    return {str(k): int(v) for k, v in frame["code_version"].fillna(UNKNOWN_CODE).value_counts().items()}


@dataclass(frozen=True)
class Results:
    """Every experiment under a results root, and what a reader of its tables should know."""

    frames: dict[str, pd.DataFrame]
    """``{experiment name: results frame}``; each frame carries ``experiment`` and ``cell`` columns."""
    warnings: list[str]
    """Unreadable cell files left out, and grids whose recorded cells are not all finished (their tables
    cover the finished ones only), one line each naming the experiment."""
    lost_per_layer: dict[str, list[str]] = field(default_factory=dict)
    """Experiment -> its cells whose recorded per-layer table is missing (:class:`~experiments.store.
    StoreContents`); no per-layer figure of such an experiment is whole."""
    refused: dict[str, str] = field(default_factory=dict)
    """Experiment -> why none of its cells can be read as its grid (a damaged ``grid.json``)."""


def load_results(root: str | Path) -> dict[str, pd.DataFrame]:
    """``{experiment name: results frame}``; each frame carries ``experiment`` and ``cell`` columns."""
    return read_results(root).frames


def read_results(root: str | Path) -> Results:
    """:func:`load_results`'s frames with the warnings about their inputs, each cell file read once."""
    out, warnings, lost, refused = {}, [], {}, {}
    for name, directory in experiment_dirs(root).items():
        store = ResultsStore(directory)
        try:
            contents = store.contents()
        except GridFileError as err:
            refused[name] = f"{name}: tables refused: {err}"
            continue
        for key in contents.corrupt:
            warnings.append(f"{name}: cell file {store.cell_path(key)} is unreadable and left out")
        if contents.lost_per_layer:
            lost[name] = contents.lost_per_layer
        if contents.unfinished:
            finished, missing = len(contents.configs), len(contents.unfinished)
            total = missing + finished + len(contents.corrupt)
            warnings.append(
                f"{name}: {missing} of the {total} cells of its grid are not finished (an interrupted or "
                f"running grid): its tables cover the {finished} finished ones; a rerun completes it"
            )
        frame, configs = contents.rows, contents.configs
        if frame.empty:
            continue
        if "param_bytes_per_gpu" not in frame:
            ep = dict(zip(frame["cell"], frame["nodes"] * frame["gpus_per_node"], strict=False))
            frame["param_bytes_per_gpu"] = [_cell_params(configs[key], int(ep[key])) for key in frame["cell"]]
        for column, (key, default) in CLUSTER_COLUMNS.items():
            if column not in frame:
                frame[column] = [_cell_cluster(configs[cell], key, default) for cell in frame["cell"]]
        if "step" not in frame:
            frame["step"] = [_cell_step(configs[cell]) for cell in frame["cell"]]
        out[name] = frame.assign(experiment=name)
    return Results(out, warnings, lost, refused)


CLUSTER_COLUMNS: dict[str, tuple[str, object]] = {
    "dispatcher": ("dispatcher", "alltoall"),
    "ep_overlap": ("ep_overlap", False),
}
"""Result columns taken from each cell's ``cluster`` config (for the communication sensitivity tables):
column -> (cluster key, its value in cells whose config predates the key)."""


def _cell_step(config: Mapping[str, Any]) -> str:
    """The cell's ``simulator.step`` (``moe`` for cells whose config predates it: they priced the MoE-only
    step)."""
    sim = config.get("simulator")
    return str(sim.get("step", "moe")) if isinstance(sim, Mapping) else "moe"


def _cell_cluster(config: Mapping[str, Any], name: str, default: object) -> object:
    cluster = config.get("cluster")
    return cluster.get(name, default) if isinstance(cluster, Mapping) else default


def _cell_params(config: Mapping[str, Any], ep_size: int) -> float:
    model = config.get("model")
    return (
        param_bytes_per_gpu(model, ep_size)
        if isinstance(model, Mapping) and "hidden" in model
        else float("nan")
    )


def load_per_layer_results(root: str | Path) -> dict[str, pd.DataFrame]:
    """``{experiment name: per-layer frame}``, joined with each cell's ``model`` and ``dataset``."""
    return read_per_layer_results(root)[0]


def read_per_layer_results(root: str | Path) -> tuple[dict[str, pd.DataFrame], dict[str, list[str]]]:
    """:func:`load_per_layer_results`'s frames and, per experiment, the cells whose per-layer file exists
    but cannot be read or trusted (left out)."""
    out, unreadable = {}, {}
    for name, directory in experiment_dirs(root).items():
        store = ResultsStore(directory)
        try:
            layers, corrupt = store.per_layer_contents()
        except GridFileError:  # NOTE: read_results refuses the experiment, naming the file
            continue
        if corrupt:
            unreadable[name] = corrupt
        if layers.empty:
            continue
        cells = store.load()
        ident = [c for c in ("model", "dataset", "nodes", "gpus_per_node") if c in cells and c not in layers]
        if ident:
            layers = layers.merge(cells[["cell", *ident]].drop_duplicates("cell"), on="cell", how="left")
        out[name] = layers.assign(experiment=name)
    return out, unreadable
