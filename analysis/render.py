"""Render a ``Table`` as Markdown, LaTeX (booktabs) or a rich terminal table."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import BinaryIO

from rich.console import Console
from rich.table import Table as RichTable
from rich.text import Text

from analysis.tables import Table
from relibra.atomic import atomic_write

__all__ = [
    "escape_latex",
    "escape_markdown_cell",
    "escape_markdown_text",
    "to_latex",
    "to_markdown",
    "to_rich",
    "write_table",
]


_MARKDOWN_CELL = re.compile(r"[\\|`\[\]<>&]")
"""What a Markdown table cell escapes: a backslash escape for ``\\``, ``|`` and the code and link marks,
HTML entities for ``<``, ``>`` and ``&`` (``&lt;`` ...), so no column, raw HTML or link can come from a
name in the results. Emphasis marks (``*``, ``_``) are left as they are: they change no structure."""
_MARKDOWN_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}
_LATEX = re.compile(r"[\\&%$#_{}~^]")
"""LaTeX's special characters: each is written as text (a caption can never run a command)."""
_LATEX_TEXT = {
    "\\": r"\textbackslash{}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def _one_line(text: str) -> str:
    """``text`` with every line break a space: a break inside a table row would end the row."""
    return " ".join(str(text).splitlines()) if "\n" in str(text) or "\r" in str(text) else str(text)


def escape_markdown_cell(text: str) -> str:
    """``text`` as the content of one Markdown table cell, shown as it reads: one line, ``\\``, ``|``,
    backticks and brackets backslash-escaped, HTML's ``<``, ``>``, ``&`` as entities."""

    def sub(match: re.Match[str]) -> str:
        char = match.group()
        return _MARKDOWN_ENTITIES.get(char, "\\" + char)

    return _MARKDOWN_CELL.sub(sub, _one_line(text))


def escape_markdown_text(text: str) -> str:
    """A heading, note or provenance line as text: one line, HTML's ``<``, ``>``, ``&`` as entities (the
    tables' own Markdown marks, code spans and brackets, are kept)."""
    return "".join(_MARKDOWN_ENTITIES.get(c, c) for c in _one_line(text))


def escape_latex(text: str) -> str:
    """``text`` as LaTeX text: every special character (``\\ & % $ # _ { } ~ ^``) escaped, line breaks as
    spaces."""
    return _LATEX.sub(lambda m: _LATEX_TEXT.get(m.group(), "\\" + m.group()), _one_line(text))


def to_markdown(table: Table) -> str:
    """GitHub-flavoured Markdown: a heading, the table, and its note; every cell, header and line escaped
    (:func:`escape_markdown_cell`, :func:`escape_markdown_text`), so a name in the results cannot add a
    column, a row, a link or HTML."""
    text = table.formatted()
    head = "| " + " | ".join(escape_markdown_cell(str(c)) for c in text.columns) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(text.columns))) + "|"
    body = [
        "| " + " | ".join(escape_markdown_cell(cell) for cell in row) + " |"
        for row in text.itertuples(index=False, name=None)
    ]
    lines = [f"### {escape_markdown_text(table.title)}", "", head, rule, *body]
    if table.note:
        lines += ["", escape_markdown_text(table.note)]
    if table.provenance:
        lines += ["", escape_markdown_text(table.provenance)]
    return "\n".join(lines) + "\n"


def to_latex(table: Table) -> str:
    """A LaTeX ``table`` float (booktabs rules, cells and headers escaped) with the title as caption
    (escaped: :func:`escape_latex`) and a label of the table's name in letters, digits and ``.:_-``."""
    text = table.formatted().replace("–", "--")
    text = text.map(_one_line)
    text.columns = [_one_line(str(c)) for c in text.columns]
    styler = text.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    caption = table.title + (f" {table.provenance}" if table.provenance else "")
    return styler.to_latex(
        caption=escape_latex(caption.replace("`", "")),
        label="tab:" + re.sub(r"[^A-Za-z0-9.:_-]", "-", table.name),
        hrules=True,
        position="ht",
        position_float="centering",
        column_format="l" + "r" * (len(text.columns) - 1),
    )


def to_rich(table: Table) -> RichTable:
    """A rich table for the terminal; columns holding paper numbers are dimmed. Every text is a
    :class:`rich.text.Text`, so a name in the results is printed as it reads, never as markup."""
    text = table.formatted()
    caption = "\n".join(t for t in (table.note, table.provenance) if t)
    out = RichTable(title=Text(table.title), caption=Text(caption) if caption else None, title_justify="left")
    for i, col in enumerate(text.columns):
        style = "dim" if "paper" in str(col) and "ours" not in str(col) else None
        out.add_column(Text(str(col)), justify="left" if i == 0 else "right", style=style)
    for row in text.itertuples(index=False, name=None):
        out.add_row(*(Text(str(cell)) for cell in row))
    return out


def _write_bytes(data: bytes, handle: BinaryIO) -> None:
    handle.write(data)


def write_table(table: Table, out_dir: Path, console: Console | None = None) -> list[Path]:
    """Write ``<name>.md`` and ``<name>.tex`` into ``out_dir`` (and print to ``console``); returns paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, tex = out_dir / f"{table.name}.md", out_dir / f"{table.name}.tex"
    for path, text in ((md, to_markdown(table)), (tex, to_latex(table))):
        atomic_write(path, partial(_write_bytes, text.encode()), path.suffix)
    if console is not None:
        console.print(to_rich(table))
    return [md, tex]
