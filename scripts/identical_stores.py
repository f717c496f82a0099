"""Whether two results stores hold identical cells: the evidence behind ``identical_versions.json``.

Usage: ``python scripts/identical_stores.py OLD_ROOT NEW_ROOT [--presets overall,ablation,...]``.

For each preset both roots hold, every cell both stores finished (same cell key) is read (verified reads)
and compared column by column, exactly, its result rows and its per-(micro-batch, layer) table, on every
column but the code version, ``trace`` (the path the trace file was read from: cells are keyed by the
trace's content, so a store moved with its trace keeps its keys) and the columns
measured with a wall clock (:func:`experiments.store.keys.wall_clock_column`: planning and control-plane
seconds). A cell that cannot be read on either side (:class:`~experiments.store.cell_files.CorruptCellError`)
differs, named. Prints per preset the cells compared and those that differ, with the first few differing cells
and columns, and the code versions on each side. Exit status 0 when at least one cell was compared and
none differs (the two code versions compute the same numbers on these cells, so
``analysis.provenance`` may take them as one: list them in ``identical_versions.json`` with this command
as the evidence), 1 otherwise, 2 for a root that is not a results store.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.store.cell_files import CorruptCellError  # noqa: E402
from experiments.store.keys import cell_key, path_keyed, wall_clock_column  # noqa: E402
from experiments.store.pair import parse_store_pair  # noqa: E402
from experiments.store.results_store import ResultsStore  # noqa: E402

SHOWN = 5
"""Differing cells printed per preset."""
NOT_COMPARED = frozenset({"code_version", "trace"})
"""Result columns that say where or by what a cell was computed, not what it computed."""
RENAMED_PER_LAYER = {"t_attention_s": "t_layer_attention_s"}
"""Per-layer columns the suite renamed (old name -> new): an old store's column is compared under its new
name, the values as exactly as any other column's (``t_layer_attention_s``: one layer's attention, named
apart from the step's ``t_attention_s`` result column, commit 563ecf6)."""


@dataclass
class PresetComparison:
    """One preset's cells compared between two stores."""

    preset: str
    compared: int = 0
    differing: list[tuple[str, str, list[str]]] = field(default_factory=list)
    """(cell key, planner, differing columns) of each cell whose rows differ."""
    versions: tuple[set[str], set[str]] = field(default_factory=lambda: (set(), set()))
    """Code versions of the compared cells: (old store's, new store's)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """Per-layer columns compared under their new name (:data:`RENAMED_PER_LAYER`)."""


def differing_columns(old: pd.DataFrame, new: pd.DataFrame) -> list[str]:
    """Result columns (not wall-clock, not ``code_version``) whose values are not exactly equal; a column
    present on one side only, or a different number of rows, counts as differing."""
    if len(old) != len(new):
        return ["<rows>"]
    columns = sorted(set(old.columns) | set(new.columns))
    out = []
    for column in columns:
        if column in NOT_COMPARED or wall_clock_column(column):
            continue
        if column not in old.columns or column not in new.columns:
            out.append(column)
            continue
        a = old[column].reset_index(drop=True)
        b = new[column].reset_index(drop=True)
        if a.dtype.kind in "fc" and b.dtype.kind in "fc":
            same = bool(np.array_equal(a.to_numpy(), b.to_numpy(), equal_nan=True))
        else:
            same = a.equals(b)
        if not same:
            out.append(column)
    return out


def current_keys(store: ResultsStore) -> dict[str, str]:
    """Current key -> stored key of every finished cell of ``store``. A cell stored under an earlier rule of
    the suite (:func:`experiments.store.keys.keyed_earlier`: its peer trace's folder in the key) is listed
    under the key its config has now, so two stores written under different rules compare cell for cell; a
    cell keyed by its trace's path, or one whose config cannot be read, keeps its own key."""
    out: dict[str, str] = {}
    for key in store.keys():
        try:
            config = store.config(key)
        except (CorruptCellError, FileNotFoundError):
            out[key] = key
            continue
        out[key if path_keyed(config) else cell_key(config)] = key
    return out


def compare_preset(old_root: Path, new_root: Path, preset: str) -> PresetComparison:
    """Every cell key that both stores of ``preset`` finished, its rows and its per-layer table compared by
    :func:`differing_columns` (per-layer columns named ``per_layer.<column>``)."""
    old_store, new_store = ResultsStore(old_root / preset), ResultsStore(new_root / preset)
    result = PresetComparison(preset)
    old_keys, new_keys = current_keys(old_store), current_keys(new_store)
    for current in sorted(set(old_keys) & set(new_keys)):
        key, old_key, new_key = current, old_keys[current], new_keys[current]
        result.compared += 1
        try:
            old, new = old_store.read(old_key), new_store.read(new_key)
            old_layers, new_layers = old_store.read_per_layer(old_key), new_store.read_per_layer(new_key)
        except CorruptCellError as err:
            result.differing.append((key, "?", [f"<unreadable: {err}>"]))
            continue
        result.versions[0].update(old["code_version"].astype(str))
        result.versions[1].update(new["code_version"].astype(str))
        columns = differing_columns(old, new)
        if (old_layers is None) != (new_layers is None):
            columns.append("<per-layer table>")
        elif old_layers is not None and new_layers is not None:
            renamed = {o: n for o, n in RENAMED_PER_LAYER.items() if o in old_layers and n not in old_layers}
            if renamed and all(n in new_layers and o not in new_layers for o, n in renamed.items()):
                result.renamed.update(renamed)
                old_layers = old_layers.rename(columns=renamed)
            columns += [f"per_layer.{c}" for c in differing_columns(old_layers, new_layers)]
        if columns:
            result.differing.append((key, str(new["planner"].iloc[0]), columns))
    return result


def main(argv: list[str] | None = None) -> int:
    old_root, new_root, chosen = parse_store_pair(__doc__.splitlines()[0], argv)
    compared = differing = 0
    versions: tuple[set[str], set[str]] = (set(), set())
    for preset in chosen:
        result = compare_preset(old_root, new_root, preset)
        compared += result.compared
        differing += len(result.differing)
        versions[0].update(result.versions[0])
        versions[1].update(result.versions[1])
        print(f"{preset}: {result.compared} cells compared, {len(result.differing)} differ")
        for old, new in sorted(result.renamed.items()):
            print(f"  per_layer.{old} of the old store compared as per_layer.{new} (renamed)")
        for key, planner, columns in result.differing[:SHOWN]:
            print(f"  {key} ({planner}): {', '.join(columns[:8])}")
    print(f"code versions: old {sorted(versions[0])}, new {sorted(versions[1])}")
    print(f"{compared} cells compared, {differing} differ")
    return 0 if compared and not differing else 1


if __name__ == "__main__":
    raise SystemExit(main())
