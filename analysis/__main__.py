"""``python -m analysis RESULTS_DIR [--out DIR]``: the paper's tables and figures from a results directory.

RESULTS_DIR holds one store per experiment (``results/<experiment>/cells/*.parquet``), or is one store.
Tables are printed and written as Markdown and LaTeX to ``--out`` (default ``RESULTS_DIR/analysis``);
figures go to ``--out/figures`` as PNG and PDF. Each table states the code version of its cells and the
command that wrote it; an experiment whose cells mix code versions is refused (exit 1,
:mod:`analysis.provenance`). Written to ``docs/results``, the tables also rewrite the generated blocks of
the hand-written docs (:mod:`analysis.docs_blocks`); ``--check-docs`` only names the stale ones (exit 1)
and ``--write-docs`` rewrites them from the committed tables.
"""

from __future__ import annotations

import argparse
import glob
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
from rich.console import Console

from analysis.claims import paper_claims
from analysis.docs_blocks import check_docs, doc_files, write_docs
from analysis.figures import all_figures
from analysis.headline import HEADLINE_PRESETS, write_headline
from analysis.load import grid_problems, read_per_layer_results, read_results
from analysis.planner_table import PLANNER_TABLE, planner_table_problem, write_planner_table
from analysis.provenance import (
    IdenticalVersionsError,
    load_identical_groups,
    mixed_versions_refusal,
    provenance_line,
)
from analysis.render import write_table
from analysis.tables import all_tables
from analysis.targets import recommended_targets
from experiments.config.checks import writable_dir
from relibra.provenance import code_version

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
    """What the reader should know about the inputs: unreadable cell files left out."""
    refused: list[str] = field(default_factory=list)
    """Experiments that got no tables because their cells mix code versions, each with why."""


def analyse(
    results_dir: Path,
    out_dir: Path | None = None,
    console: Console | None = None,
    command: str | None = None,
) -> AnalysisOutput:
    """Build every table and figure the results allow; print tables to ``console`` when given.

    An experiment whose cells mix code versions gets no tables (:func:`analysis.provenance.
    mixed_versions_refusal`; the reason is in ``refused``). Every table states the code version of its cells
    and ``command``, the command that wrote it (default: ``python -m analysis RESULTS_DIR``).
    """
    out_dir = out_dir or results_dir / "analysis"
    command = command or f"python -m analysis {results_dir}"
    loaded = read_results(results_dir)
    results, warnings = loaded.frames, loaded.warnings
    if not results and not loaded.refused:
        raise FileNotFoundError(
            f"no finished cells under {results_dir} (expected <experiment>/cells/*.parquet)"
        )
    groups = load_identical_groups(results_dir)
    refusals = dict(loaded.refused) | {
        name: why for name, frame in results.items() if (why := mixed_versions_refusal(name, frame, groups))
    }
    refused = list(refusals.values())
    results = {n: f for n, f in results.items() if n not in refusals}
    for name in refusals:  # NOTE: an earlier run's tables and figures of it would pass for this run's
        warnings += _remove_outputs(out_dir, name)
    tables: list[Path] = []
    built, skipped = all_tables(results)
    try:  # NOTE: across every grid, so not one of all_tables' per-experiment builders
        built.append(recommended_targets(results))
    except (ValueError, KeyError) as exc:
        skipped.append(f"recommended_targets skipped: {exc}")
    everything = pd.concat(list(results.values()), ignore_index=True) if results else pd.DataFrame()
    for table in built:  # NOTE: a table over every grid (no ``<experiment>.`` prefix) states all its cells
        source = results.get(table.name.split(".", 1)[0], everything)
        line = provenance_line(source, command, code_version())
        tables += write_table(replace(table, provenance=line), out_dir, console)
    if results:
        try:
            claims = paper_claims(results)
        except (ValueError, KeyError) as exc:  # NOTE: a partial grid must not cost the other tables
            skipped.append(f"paper_claims skipped: {exc}")
        else:
            line = provenance_line(everything, command, code_version())
            tables += write_table(replace(claims, provenance=line), out_dir, console)
    per_layer, unreadable = read_per_layer_results(results_dir)
    per_layer = {n: f for n, f in per_layer.items() if n in results}
    for name in sorted(set(loaded.lost_per_layer) | set(unreadable)):
        if name not in results:
            continue
        bad = sorted(set(loaded.lost_per_layer.get(name, [])) | set(unreadable.get(name, [])))
        per_layer.pop(name, None)  # NOTE: a figure without some of its cells would pass for a whole one
        skipped.append(
            f"{name}: per-layer figures skipped: the per-layer tables of {len(bad)} cell(s) are missing or "
            f"unreadable ({', '.join(f'per_layer/{k}.parquet' for k in bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); a rerun of the preset (python -m experiments.reproduce) "
            "recomputes those cells"
        )
    drawn = {n: _plain_labels(f) for n, f in results.items()}
    figures, skipped_figures = all_figures(
        drawn, {n: _plain_labels(f) for n, f in per_layer.items()}, out_dir / "figures"
    )
    skipped += skipped_figures
    if any(preset in results for preset in HEADLINE_PRESETS):  # NOTE: drawn from the overall preset only
        try:
            figures += write_headline(drawn, out_dir)
        except (ValueError, KeyError) as exc:  # NOTE: a partial grid must not cost the other figures
            skipped.append(f"headline figure skipped: {exc}")
    elif any(preset in refusals for preset in HEADLINE_PRESETS):
        warnings += _remove_outputs(out_dir, "headline")
    if console is not None:
        for why in [*warnings, *skipped]:
            console.print(why, style="yellow", markup=False, highlight=False)
        for why in refused:
            console.print(why, style="red", markup=False, highlight=False)
    return AnalysisOutput(tables, figures, out_dir, skipped, warnings, refused)


LABEL_COLUMNS = ("dataset", "model")
"""Result columns whose names become figure labels."""


def _plain_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each ``$`` of :data:`LABEL_COLUMNS` escaped (``\\$``), so matplotlib draws a name
    as it reads instead of parsing it as mathtext (a name with ``$\\frac{`` cost every figure)."""
    out = frame
    for column in LABEL_COLUMNS:
        if column in out and not pd.api.types.is_numeric_dtype(out[column]):
            texts = out[column].astype(str)
            if texts.str.contains("$", regex=False).any():
                out = out.assign(**{column: texts.str.replace("$", r"\$", regex=False)})
    return out


def _remove_outputs(out_dir: Path, name: str) -> list[str]:
    """Remove the tables (``<name>.*``) and figures (``figures/<name>.*``) an earlier run wrote for
    ``name``, whose cells are refused now; one line saying what went, or none when nothing was there."""
    pattern = glob.escape(name) + ".*"
    gone = [
        p for folder in (out_dir, out_dir / "figures") for p in sorted(folder.glob(pattern)) if p.is_file()
    ]
    for path in gone:
        path.unlink()
    if not gone:
        return []
    return [
        f"{name}: removed {len(gone)} table and figure files of an earlier run from {out_dir} "
        "(its cells are refused now)"
    ]


REPO = Path(__file__).resolve().parents[1]
DOCS_RESULTS = REPO / "docs" / "results"
"""The committed tables that the docs' generated blocks are read from."""


def _docs(tables_dir: Path, write: bool) -> int:
    """``--check-docs`` / ``--write-docs``: 1 naming each stale or broken block, else 0."""
    docs = doc_files(REPO)
    if write:
        if write_planner_table(tables_dir):
            print(f"rewrote the planner table {tables_dir / PLANNER_TABLE}.md from the planner registry")
        changed, broken = write_docs(docs, tables_dir)
        for path in changed:
            print(f"rewrote the generated blocks of {path}")
        for block in broken:
            print(block, file=sys.stderr)
        return 1 if broken else 0
    stale = [str(b) for b in check_docs(docs, tables_dir)]
    stale += [why] if (why := planner_table_problem(tables_dir)) else []
    for line in stale:
        print(line, file=sys.stderr)
    if stale:
        print(f"{len(stale)} generated block(s) stale or broken; `python -m analysis --write-docs` "
              "rewrites the stale ones", file=sys.stderr)  # fmt: skip
    return 1 if stale else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis", description=__doc__.splitlines()[0])
    parser.add_argument(
        "results_dir", type=Path, nargs="?", help="results root (one folder per experiment) or one store"
    )
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RESULTS_DIR/analysis)")
    parser.add_argument(
        "--check-docs",
        action="store_true",
        help="name each generated block of README.md and docs/*.md stale against --tables (exit 1 if any)",
    )
    parser.add_argument(
        "--write-docs", action="store_true", help="rewrite the generated blocks of the docs from --tables"
    )
    parser.add_argument(
        "--tables",
        type=Path,
        default=DOCS_RESULTS,
        help="tables the docs' blocks read (default docs/results)",
    )
    args = parser.parse_args(argv)
    if args.check_docs or args.write_docs:
        if not args.tables.is_dir():
            print(f"python -m analysis: --tables {args.tables}: no such directory", file=sys.stderr)
            return 2
        return _docs(args.tables, write=args.write_docs)
    console = Console() if sys.stdout.isatty() else Console(width=160)  # NOTE: rich assumes 80 off a tty
    if args.results_dir is None:
        parser.print_usage(sys.stderr)
        print("python -m analysis: RESULTS_DIR is required (or --check-docs / --write-docs)", file=sys.stderr)
        return 2
    if not args.results_dir.is_dir():
        print(f"python -m analysis: {args.results_dir}: no such results directory", file=sys.stderr)
        return 2
    command = "python -m analysis " + " ".join(argv if argv is not None else sys.argv[1:])
    problems = grid_problems(args.results_dir)  # NOTE: all before any table is written
    out_dir = args.out or args.results_dir / "analysis"
    if why := writable_dir("--out", str(out_dir)):
        problems.append(why)
    if problems:
        for why in problems:
            print(f"python -m analysis: {why}", file=sys.stderr)
        return 2
    try:
        out = analyse(args.results_dir, args.out, console, command)
    except (FileNotFoundError, IdenticalVersionsError) as exc:  # NOTE: nothing to build tables from
        print(f"python -m analysis: {exc}", file=sys.stderr)
        return 2
    console.print(f"tables: {out.out_dir} ({len(out.tables)} files)", markup=False)
    console.print(f"figures: {out.out_dir / 'figures'} ({len(out.figures)} files)", markup=False)
    if out.out_dir.resolve() == DOCS_RESULTS.resolve():
        write_planner_table(DOCS_RESULTS)
        changed, broken = write_docs(doc_files(REPO), DOCS_RESULTS)
        console.print(f"generated blocks rewritten in {len(changed)} doc(s)")
        for block in broken:
            console.print(str(block), style="red", markup=False)
    if out.refused:
        return 1
    if not out.tables and not out.figures:
        console.print(
            f"no table or figure could be built from {args.results_dir} (reasons above)",
            style="red",
            markup=False,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
