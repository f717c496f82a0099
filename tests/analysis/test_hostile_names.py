"""Names from the results (datasets, paths) cannot forge the tables: Markdown, LaTeX and the terminal
print them as they read."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from analysis.__main__ import analyse, main
from analysis.docs_blocks import read_markdown_table
from analysis.render import escape_latex, escape_markdown_cell
from tests.analysis.test_analysis import MODELS, _row, _write

CORE = ["megatron", "popfetcher", "eplb", "lplb", "relibra", "balanced", "force_balanced"]
FORGED = "x | 9.99 | <img src=x onerror=alert(1)>"
"""The issue's dataset name: two extra columns and raw HTML, were it written as it is."""
HOSTILE = [FORGED, "[/]x", "[bold]y\nz", r"\input{/etc/passwd} ^ ~ & % $ # _ { } `tick` [l](http://e)"]


def _results(root: Path, datasets: list[str]) -> Path:
    rows = [_row(m, d, p, 4) for m in MODELS for d in datasets for p in CORE]
    _write(root, "quick_overall", rows, layers=True)
    abl = ["megatron", "relibra_reorder_no_locality", "relibra_reorder_only", "relibra"]
    _write(root, "quick_ablation", [_row(m, d, p, 4) for m in MODELS for d in datasets for p in abl])
    return root


def _unescaped_pipes(line: str) -> int:
    return len(re.findall(r"(?<!\\)(?:\\\\)*\|", line))


def test_a_dataset_name_cannot_add_columns_rows_or_html_to_a_markdown_table(tmp_path: Path) -> None:
    out = analyse(_results(tmp_path, HOSTILE), tmp_path / "out")
    md = [p for p in out.tables if p.suffix == ".md"]
    assert md
    for path in md:
        text = path.read_text()
        assert "<img" not in text and "<" not in text.replace("&lt;", ""), path
        rows = [ln for ln in text.splitlines() if ln.startswith("|")]
        assert len({_unescaped_pipes(ln) for ln in rows}) == 1, (path, rows)
    header, rows = read_markdown_table(tmp_path / "out" / "quick_overall.overall_cells.md")
    named = {row[header.index("dataset")] for row in rows}
    assert set(HOSTILE[:3]) - {"[bold]y\nz"} <= named and "[bold]y z" in named, named


def test_latex_captions_and_cells_escape_every_special_character(tmp_path: Path) -> None:
    """A dataset or an ``--out`` path with ``\\input{...}``: never a live command in the ``.tex``."""
    out_dir = tmp_path / r"o\input{evil}^~"
    assert main([str(_results(tmp_path / "r", HOSTILE)), "--out", str(out_dir)]) == 0
    tex = list(out_dir.glob("*.tex"))
    assert tex
    for path in tex:
        text = path.read_text()
        assert not re.search(r"\\input", text), path
        assert r"\textbackslash{}input\{evil\}\textasciicircum{}\textasciitilde{}" in text, path


def test_escapes_round_trip_what_a_reader_sees() -> None:
    assert escape_markdown_cell("a|b<c>&d\\e`f`[g]") == r"a\|b&lt;c&gt;&amp;d\\e\`f\`\[g\]"
    assert escape_latex("\\ & % $ # _ { } ~ ^") == (
        r"\textbackslash{} \& \% \$ \# \_ \{ \} \textasciitilde{} \textasciicircum{}"
    )


def test_rich_markup_in_a_name_is_printed_as_it_reads(tmp_path: Path) -> None:
    """The issue's probe (``[/]x``): no MarkupError part-way, every table and figure written, and the
    claims' verdict keeps its ``[a, b]`` ranges."""
    plain = analyse(_results(tmp_path / "plain", ["reasoning", "mixed"]), tmp_path / "plain_out")
    sink = io.StringIO()
    console = Console(file=sink, width=400)
    hostile = analyse(_results(tmp_path / "hostile", ["[/]x", "[red]mixed"]), tmp_path / "h_out", console)
    assert len(hostile.tables) == len(plain.tables) and len(hostile.figures) == len(plain.figures)
    printed = sink.getvalue()
    assert "[/]x" in printed and "[red]mixed" in printed
    assert "all lie in [lo x 0.95, hi x 1.05]" in " ".join(printed.split()), printed[-3000:]


@pytest.mark.parametrize("name", ["[/]x"])
def test_a_markup_path_is_printed_as_it_reads(tmp_path: Path, name: str) -> None:
    root = _results(tmp_path / name, ["reasoning", "mixed"])
    assert main([str(root), "--out", str(tmp_path / f"{name}out")]) == 0


def test_a_command_cannot_end_the_provenance_code_span() -> None:
    import pandas as pd

    from analysis.provenance import provenance_line

    line = provenance_line(pd.DataFrame({"code_version": ["0.1.0+ga"]}), "python -m analysis `x`\nr", "v")
    assert line.count("`") == 6 and "'x' r" in line, line


def test_a_stored_experiment_name_that_is_a_path_never_names_output_files(tmp_path: Path) -> None:
    """A copied store whose cells hold ``experiment_name=../../x``: its files stay in ``--out``, named by
    its folder."""
    import pandas as pd

    from experiments.store.keys import cell_key
    from experiments.store.results_store import ResultsStore

    store = ResultsStore(tmp_path / "r" / "quick_overhead")
    for i, model in enumerate(MODELS):
        config = {"i": i, "experiment_name": "../../escaped"}
        store.write(cell_key(config), pd.DataFrame([_row(model, "mixed", "relibra", 4)]), config)
    out = analyse(tmp_path / "r", tmp_path / "r" / "out")
    assert out.tables and all(p.parent == tmp_path / "r" / "out" for p in out.tables)
    assert any(p.name.startswith("quick_overhead.") for p in out.tables)
    assert not list(tmp_path.rglob("*escaped*"))


def test_a_dollar_in_a_name_is_drawn_as_it_reads_not_parsed_as_mathtext(tmp_path: Path) -> None:
    r"""A dataset ``a$\frac{x$`` made matplotlib's mathtext parser fail every figure that names it."""
    plain = analyse(_results(tmp_path / "plain", ["reasoning", "mixed"]), tmp_path / "plain_out")
    dollar = analyse(_results(tmp_path / "dollar", ["a$\\frac{x$", "b^_$"]), tmp_path / "dollar_out")
    assert len(dollar.figures) == len(plain.figures) > 0, dollar.skipped
