"""Render a ``Table`` as Markdown, LaTeX (booktabs) or a rich terminal table."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table as RichTable

from analysis.tables import Table

__all__ = ["to_latex", "to_markdown", "to_rich", "write_table"]


def to_markdown(table: Table) -> str:
    """GitHub-flavoured Markdown: a heading, the table, and its note."""
    text = table.formatted()
    head = "| " + " | ".join(map(str, text.columns)) + " |"
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(text.columns))) + "|"
    body = ["| " + " | ".join(row) + " |" for row in text.itertuples(index=False, name=None)]
    lines = [f"### {table.title}", "", head, rule, *body]
    if table.note:
        lines += ["", table.note]
    if table.provenance:
        lines += ["", table.provenance]
    return "\n".join(lines) + "\n"


def _escape_latex(text: str) -> str:
    """``text`` with LaTeX's special characters escaped (for the caption; cells go through the Styler)."""
    for char in ("&", "%", "$", "#", "_", "{", "}"):
        text = text.replace(char, "\\" + char)
    return text


def to_latex(table: Table) -> str:
    """A LaTeX ``table`` float (booktabs rules, cells and headers escaped) with the title as caption."""
    text = table.formatted().replace("–", "--")
    styler = text.style.hide(axis="index").format(escape="latex").format_index(escape="latex", axis=1)
    caption = table.title + (f" {table.provenance}" if table.provenance else "")
    return styler.to_latex(
        caption=_escape_latex(caption.replace("`", "")),
        label=f"tab:{table.name}",
        hrules=True,
        position="ht",
        position_float="centering",
        column_format="l" + "r" * (len(text.columns) - 1),
    )


def to_rich(table: Table) -> RichTable:
    """A rich table for the terminal; columns holding paper numbers are dimmed."""
    text = table.formatted()
    caption = "\n".join(t for t in (table.note, table.provenance) if t)
    out = RichTable(title=table.title, caption=caption or None, title_justify="left")
    for i, col in enumerate(text.columns):
        style = "dim" if "paper" in str(col) and "ours" not in str(col) else None
        out.add_column(str(col), justify="left" if i == 0 else "right", style=style)
    for row in text.itertuples(index=False, name=None):
        out.add_row(*row)
    return out


def write_table(table: Table, out_dir: Path, console: Console | None = None) -> list[Path]:
    """Write ``<name>.md`` and ``<name>.tex`` into ``out_dir`` (and print to ``console``); returns paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, tex = out_dir / f"{table.name}.md", out_dir / f"{table.name}.tex"
    md.write_text(to_markdown(table))
    tex.write_text(to_latex(table))
    if console is not None:
        console.print(to_rich(table))
    return [md, tex]
