"""``python -m analysis RESULTS_DIR [--out DIR]``: the paper's tables and figures from a results directory.

RESULTS_DIR holds one store per experiment (``results/<experiment>/cells/*.parquet``), or is one store.
Tables are printed and written as Markdown and LaTeX to ``--out`` (default ``RESULTS_DIR/analysis``);
figures go to ``--out/figures`` as PNG and PDF.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from rich.console import Console

from analysis.figures import all_figures
from analysis.headline import HEADLINE_PRESETS, write_headline
from analysis.load import code_versions, experiment_dirs, load_per_layer_results, load_results
from analysis.render import write_table
from analysis.tables import all_tables
from analysis.targets import recommended_targets
from experiments.store import ResultsStore

__all__ = ["AnalysisOutput", "analyse", "main"]


@dataclass(frozen=True)
class AnalysisOutput:
    """Where the analysis wrote its files."""

    tables: list[Path]
    figures: list[Path]
    out_dir: Path
    skipped: list[str]
    """Why a table or figure could not be built (e.g. a planner missing from a partial grid)."""
    warnings: list[str] = field(default_factory=list)
    """What the reader should know about the inputs: cells of several code versions merged in one table,
    unreadable cell files left out."""


def analyse(results_dir: Path, out_dir: Path | None = None, console: Console | None = None) -> AnalysisOutput:
    """Build every table and figure the results allow; print tables to ``console`` when given."""
    out_dir = out_dir or results_dir / "analysis"
    results = load_results(results_dir)
    if not results:
        raise FileNotFoundError(
            f"no finished cells under {results_dir} (expected <experiment>/cells/*.parquet)"
        )
    warnings = _input_warnings(results_dir, results)
    tables: list[Path] = []
    built, skipped = all_tables(results)
    try:  # NOTE: across every grid, so not one of all_tables' per-experiment builders
        built.append(recommended_targets(results))
    except (ValueError, KeyError) as exc:
        skipped.append(f"recommended_targets skipped: {exc}")
    for table in built:
        tables += write_table(table, out_dir, console)
    figures, skipped_figures = all_figures(results, load_per_layer_results(results_dir), out_dir / "figures")
    skipped += skipped_figures
    if any(preset in results for preset in HEADLINE_PRESETS):  # NOTE: drawn from the overall preset only
        try:
            figures += write_headline(results, out_dir)
        except (ValueError, KeyError) as exc:  # NOTE: a partial grid must not cost the other figures
            skipped.append(f"headline figure skipped: {exc}")
    if console is not None:
        for why in [*warnings, *skipped]:
            console.print(f"[yellow]{why}")
    return AnalysisOutput(tables, figures, out_dir, skipped, warnings)


def _input_warnings(results_dir: Path, results: dict[str, pd.DataFrame]) -> list[str]:
    out = []
    for name, frame in results.items():
        versions = code_versions(frame)
        if len(versions) > 1:
            listed = ", ".join(f"{n} rows by {v}" for v, n in sorted(versions.items()))
            out.append(
                f"{name}: its tables merge cells computed by {len(versions)} code versions ({listed}); "
                "`python -m experiments.reproduce --recompute-stale` recomputes the older ones"
            )
    for name, directory in experiment_dirs(results_dir).items():
        for key in ResultsStore(directory).corrupt_keys():
            out.append(
                f"{name}: cell file {ResultsStore(directory).cell_path(key)} is unreadable and left out"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results_dir", type=Path, help="results root (one folder per experiment) or one store"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RESULTS_DIR/analysis)")
    args = parser.parse_args(argv)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # NOTE: rich assumes 80 off a tty
    if not args.results_dir.is_dir():
        print(f"python -m analysis: {args.results_dir}: no such results directory", file=sys.stderr)
        return 2
    try:
        out = analyse(args.results_dir, args.out, console)
    except FileNotFoundError as exc:  # NOTE: an empty store: nothing to build tables from
        print(f"python -m analysis: {exc}", file=sys.stderr)
        return 2
    console.print(f"tables: {out.out_dir} ({len(out.tables)} files)")
    console.print(f"figures: {out.out_dir / 'figures'} ({len(out.figures)} files)")
    if not out.tables and not out.figures:
        console.print(f"[red]no table or figure could be built from {args.results_dir} (reasons above)")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
