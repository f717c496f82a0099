"""Generated blocks in the docs: rendered from the tables, stale ones named, the committed docs up to date."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.__main__ import REPO, main
from analysis.docs_blocks import BlockError, check_docs, doc_files, render_block, write_docs

TABLE = """### Skewness [ep_scaling]

| EP | Megatron-LM | ReLibra (paper) | note |
|---|---:|---:|---:|
| 8 | 1.210 | 1.020 | – |
| 16 | 1.400 | 1.150 | 1.3 tie |
| 32 | 1.620 | 1.080 | – |
"""


@pytest.fixture
def tables(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    (out / "ep_scaling.skew_by_ep.md").write_text(TABLE)
    return out


def test_a_table_block_embeds_the_whole_file(tables: Path) -> None:
    assert render_block("ep_scaling.skew_by_ep", tables) == "\n" + TABLE.rstrip("\n") + "\n"


def test_a_column_block_is_its_range_as_the_table_writes_it(tables: Path) -> None:
    assert render_block('ep_scaling.skew_by_ep "ReLibra (paper)"', tables) == "1.020-1.150"
    assert render_block("ep_scaling.skew_by_ep Megatron-LM EP=16", tables) == "1.400"
    assert render_block("ep_scaling.skew_by_ep note", tables) == "1.3"  # the leading number of a cell


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ("nope.table", "no table nope.table"),
        ("ep_scaling.skew_by_ep spread", "no column 'spread'"),
        ("ep_scaling.skew_by_ep Megatron-LM EP=128", "no row with a number in 'Megatron-LM' where EP=128"),
        ("ep_scaling.skew_by_ep Megatron-LM EP", "'EP' is not KEY=VALUE"),
    ],
)
def test_a_bad_spec_is_named(tables: Path, spec: str, named: str) -> None:
    with pytest.raises(BlockError, match=named):
        render_block(spec, tables)


def test_a_stale_block_is_named_and_rewritten(tables: Path, tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    fresh = '<!-- generated: ep_scaling.skew_by_ep "ReLibra (paper)" -->1.020-1.150<!-- end -->'
    doc.write_text(
        f"Intro.\n\nReLibra: {fresh} at EP 8-32.\n\n"
        "Megatron-LM at EP 16: <!-- generated: ep_scaling.skew_by_ep Megatron-LM EP=16 -->1.10<!-- end -->.\n"
        "<!-- generated: missing.table -->x<!-- end -->\n"
    )
    stale = check_docs([doc], tables)
    assert [(b.line, b.spec) for b in stale] == [
        (5, "ep_scaling.skew_by_ep Megatron-LM EP=16"),
        (6, "missing.table"),
    ]
    assert "differs from" in stale[0].why and "is broken: no table missing.table" in stale[1].why
    assert str(stale[0]).startswith(f"{doc}:5: generated block 'ep_scaling.skew_by_ep Megatron-LM EP=16'")
    changed, broken = write_docs([doc], tables)
    assert changed == [doc] and [b.spec for b in broken] == ["missing.table"]
    text = doc.read_text()
    assert "EP=16 -->1.400<!-- end -->" in text and fresh in text
    assert [b.spec for b in check_docs([doc], tables)] == ["missing.table"]  # the broken one stays named


def test_check_docs_exits_1_naming_each_stale_block(tables: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The committed docs read the committed tables; against other tables their blocks are stale or broken."""
    assert main(["--check-docs", "--tables", str(tables)]) == 1
    err = capsys.readouterr().err
    assert "generated block" in err and "stale or broken" in err, err


def test_the_committed_docs_are_up_to_date_with_docs_results(capsys: pytest.CaptureFixture[str]) -> None:
    blocks = sum(path.read_text().count("<!-- generated: ") for path in doc_files(REPO))
    assert blocks > 0  # the docs quote their numbers through generated blocks
    assert main(["--check-docs"]) == 0, capsys.readouterr().err


def test_check_docs_refuses_a_missing_tables_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check-docs", "--tables", str(tmp_path / "none")]) == 2
    assert "--tables" in capsys.readouterr().err


def test_an_escaped_cell_reads_as_written_and_a_comment_marker_is_refused(tables: Path) -> None:
    """A range block matches KEY=VALUE against the cell as it reads (``\\|`` is a ``|``); a table file
    holding ``-->`` (an edited one: the analysis escapes ``>``) would end the block early."""
    (tables / "t.md").write_text("| dataset | x |\n|---|---:|\n| a \\| b | 1.5 |\n| c | 2.5 |\n")
    assert render_block("t x 'dataset=a | b'", tables) == "1.5"
    (tables / "bad.md").write_text("| a |\n|---|\n| x --> y |\n")
    with pytest.raises(BlockError, match="HTML comment marker"):
        render_block("bad", tables)
