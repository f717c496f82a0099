"""The planner table of the docs, generated from the planner registry (:mod:`relibra.planners.registry`).

``python -m analysis --write-docs`` writes it to ``docs/results/planners.md``, and the README embeds it as a
generated block (``<!-- generated: planners -->``, :mod:`analysis.docs_blocks`); ``--check-docs`` names it
when it is not what the registry gives now.
"""

from __future__ import annotations

from pathlib import Path

from analysis.render import escape_markdown_cell
from relibra.planners.registry import CARDS, FAMILIES, INFORMATION

__all__ = ["PLANNER_TABLE", "planner_table", "planner_table_problem", "write_planner_table"]

PLANNER_TABLE = "planners"
"""The table's name: ``<tables>/planners.md``, the block ``<!-- generated: planners -->``."""


def planner_table() -> str:
    """Every registered planner, one row each in registry order, then what its words mean (Markdown)."""
    rows = [
        "| `planner=` | label | family | plans from | builds (its node's `_target_`) |",
        "|---|---|---|---|---|",
    ]
    for c in CARDS:
        settings = f"`{c.settings}`" + (f" (a variant of `{c.variant_of}`)" if c.variant_of else "")
        information = ", ".join(f"`{i}`" for i in c.information)
        rows.append(
            f"| `{c.name}` | {escape_markdown_cell(c.label)} | {c.family} | {information} | {settings} |"
        )
    families = "; ".join(f"**{name}**: {escape_markdown_cell(text)}" for name, text in FAMILIES.items())
    information = "; ".join(f"`{name}`: {escape_markdown_cell(text)}" for name, text in INFORMATION.items())
    return "\n".join(
        [
            *rows,
            "",
            f"Families: {families}.",
            "",
            f"Plans from: {information}.",
            "",
        ]
    )


def write_planner_table(tables_dir: Path) -> bool:
    """Write :func:`planner_table` to ``tables_dir/planners.md``; whether the file changed."""
    path = tables_dir / f"{PLANNER_TABLE}.md"
    text = planner_table()
    if path.is_file() and path.read_text() == text:
        return False
    path.write_text(text)
    return True


def planner_table_problem(tables_dir: Path) -> str | None:
    """Why ``tables_dir/planners.md`` is not the registry's table now (missing or stale), or None."""
    path = tables_dir / f"{PLANNER_TABLE}.md"
    if not path.is_file():
        return (
            f"{path}: missing; `python -m analysis --write-docs` writes the planner table from the registry"
        )
    if path.read_text() != planner_table():
        return f"{path}: differs from the planner registry; `python -m analysis --write-docs` rewrites it"
    return None
