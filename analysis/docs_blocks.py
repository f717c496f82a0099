"""Generated blocks in the hand-written docs: numbers a table produces are copied by the analysis, not by hand

A doc embeds a number or a table of ``docs/results/`` as a block that ``python -m analysis`` rewrites::

    <!-- generated: overhead.overhead -->            (the whole table docs/results/overhead.overhead.md)
    ...
    <!-- end -->
    skewness <!-- generated: ep_scaling.skew_by_ep "ReLibra (paper)" -->1.02-1.15<!-- end --> at EP 8-64

The spec after ``generated:`` is shell-quoted words: ``TABLE [COLUMN [KEY=VALUE ...]]``. ``TABLE`` alone
embeds the table's Markdown file; with ``COLUMN`` the block is the range ``lo-hi`` of that column over the
table's rows (one value when they agree), written as the table writes the numbers, over the rows whose
column ``KEY`` reads ``VALUE`` (every pair must hold). ``python -m analysis --check-docs`` names each block
whose text differs from what the tables give now (a stale block), or whose spec names no table, column or
row, and exits 1.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BLOCK",
    "BlockError",
    "StaleBlock",
    "check_docs",
    "doc_files",
    "read_markdown_table",
    "render_block",
    "write_docs",
]

BLOCK = re.compile(r"<!-- generated: (?P<spec>.*?) -->(?P<body>.*?)<!-- end -->", re.S)
"""A generated block; ``body`` is what the analysis writes between the markers."""
NUMBER = re.compile(r"^[-+]?\d+(?:\.\d+)?")
"""The leading number of a table cell (cells may add a spread or a mark after it)."""


class BlockError(ValueError):
    """A block's spec names no table, column or row; the message says which."""


@dataclass(frozen=True)
class StaleBlock:
    """One block whose text is not what the tables give now."""

    path: Path
    line: int
    """1-based line of the block's opening marker."""
    spec: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: generated block '{self.spec}' {self.why}"


def doc_files(repo: Path) -> list[Path]:
    """The hand-written docs: ``README.md``, ``docs/*.md`` and the measurement records ``docs/records/*.md``
    (``docs/results/`` is generated itself)."""
    docs = repo / "docs"
    pages = [repo / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "records").glob("*.md"))]
    return [p for p in pages if p.is_file()]


def read_markdown_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """Header and rows (cell texts) of the first Markdown table in ``path``."""
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if start is None:
        raise BlockError(f"{path}: holds no Markdown table")
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append(_cells(ln))
    return rows[0], rows[2:]


_CELL_SPLIT = re.compile(r"(?<!\\)((?:\\\\)*)\|")
"""A ``|`` that ends a cell: one not backslash-escaped (preceded by an even run of backslashes)."""
_ESCAPED = re.compile(r"\\(.)|&(lt|gt|amp);")
_ENTITY = {"lt": "<", "gt": ">", "amp": "&"}


def _cells(line: str) -> list[str]:
    """The cell texts of one Markdown table row, as they read (``analysis.render.escape_markdown_cell``
    undone: ``\\|`` is a ``|`` inside a cell)."""
    inner = line.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = _CELL_SPLIT.sub(lambda m: m.group(1) + "\0", inner)
    cells = inner.split("\0")
    if cells and not cells[-1].strip():
        cells = cells[:-1]
    return [
        _ESCAPED.sub(lambda m: m.group(1) if m.group(1) is not None else _ENTITY[m.group(2)], c.strip())
        for c in cells
    ]


def _range(header: list[str], rows: list[list[str]], column: str, where: dict[str, str], name: str) -> str:
    for key in [column, *where]:
        if key not in header:
            raise BlockError(f"table {name} has no column '{key}' (columns: {', '.join(header)})")
    col = header.index(column)
    picked = [r for r in rows if all(r[header.index(k)] == v for k, v in where.items())]
    cells = [(float(m.group()), m.group()) for r in picked if (m := NUMBER.match(r[col]))]
    if not cells:
        filt = " ".join(f"{k}={v}" for k, v in where.items())
        where_text = f" where {filt}" if filt else ""
        raise BlockError(f"table {name}: no row with a number in '{column}'{where_text}")
    lo, hi = min(cells)[1], max(cells)[1]
    return lo if lo == hi else f"{lo}-{hi}"


def render_block(spec: str, tables_dir: Path) -> str:
    """The text a block of ``spec`` holds, from the Markdown tables in ``tables_dir``."""
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise BlockError(f"spec '{spec}': {exc}") from exc
    if not words:
        raise BlockError("empty spec (expected TABLE [COLUMN [KEY=VALUE ...]])")
    name, rest = words[0], words[1:]
    path = tables_dir / f"{name}.md"
    if not path.is_file():
        raise BlockError(f"no table {name} ({path} does not exist)")
    if not rest:
        text = path.read_text()
        if "<!--" in text or "-->" in text:  # NOTE: the analysis escapes "<" and ">"; an edited file may not
            raise BlockError(f"table {name} ({path}) holds an HTML comment marker, which would end the block")
        return "\n" + text.rstrip("\n") + "\n"
    where = {}
    for word in rest[1:]:
        key, sep, value = word.partition("=")
        if not sep:
            raise BlockError(f"spec '{spec}': '{word}' is not KEY=VALUE")
        where[key] = value
    header, rows = read_markdown_table(path)
    return _range(header, rows, rest[0], where, name)


def _rewrite(text: str, tables_dir: Path, path: Path) -> tuple[str, list[StaleBlock]]:
    """``text`` with every block rewritten, and the blocks that were stale or broken."""
    stale: list[StaleBlock] = []

    def fill(match: re.Match[str]) -> str:
        line = text.count("\n", 0, match.start()) + 1
        spec = match.group("spec")
        try:
            body = render_block(spec, tables_dir)
        except BlockError as exc:
            stale.append(StaleBlock(path, line, spec, f"is broken: {exc}"))
            return match.group(0)
        if body != match.group("body"):
            stale.append(StaleBlock(path, line, spec, f"differs from {tables_dir}"))
        return f"<!-- generated: {spec} -->{body}<!-- end -->"

    return BLOCK.sub(fill, text), stale


def check_docs(docs: list[Path], tables_dir: Path) -> list[StaleBlock]:
    """Every block of ``docs`` that is stale against ``tables_dir`` or broken (nothing is written)."""
    return [block for path in docs for block in _rewrite(path.read_text(), tables_dir, path)[1]]


def write_docs(docs: list[Path], tables_dir: Path) -> tuple[list[Path], list[StaleBlock]]:
    """Rewrite every block of ``docs`` from ``tables_dir``; the files changed and the broken blocks (left
    as they were)."""
    changed, broken = [], []
    for path in docs:
        text = path.read_text()
        new, stale = _rewrite(text, tables_dir, path)
        broken += [b for b in stale if b.why.startswith("is broken")]
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed, broken
