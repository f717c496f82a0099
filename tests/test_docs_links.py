"""The docs as a manual: every relative link resolves, every manual page stays short, every cited page exists.

Links: every relative Markdown link of ``README.md``, ``CHANGELOG.md`` and ``docs/**/*.md`` names a file that
exists and, where it has an ``#anchor``, a heading of that file, by GitHub's slug rule (lower case; every
character that is not a letter, a digit, a space, ``-`` or ``_`` dropped; spaces to ``-``; a repeated slug
gets ``-1``, ``-2``, ...). Fenced code and inline code are not read. Length: a page of ``docs/`` outside
``docs/records/`` (dated measurements) and ``docs/results/`` (generated tables) stays under
``MAX_MANUAL_LINES`` lines (issue 57: "every page ... stays under about 400 lines").

Citations: the design lives in the repository (issue 57, part 4: "the architecture document in the
repository, and each module's docstring pointing into it"). No file of the source trees, the docs or the
top-level files but ``CHANGELOG.md`` (history) names the design notes kept outside the repository
(``DESIGN_NOTES``), and every ``docs/<page>.md`` or ``README.md`` that a ``.py`` or ``.yaml`` file names
exists; where the name is followed by a quoted title (``docs/spine.md, "Result columns"``), a heading or a
table row's first cell (a glossary term) of that page starts with it.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MANUAL_LINES = 400
"""Issue 57, part 5: a manual page stays under about 400 lines; records and generated tables may be longer."""

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
DESIGN_NOTES = "DESIGN" + ".md"
"""The design notes outside the repository (``../shared/``), which a clone lacks: nothing may cite them."""
SOURCE_ROOTS = (
    "relibra",
    "baselines",
    "experiments",
    "analysis",
    "benchmarks",
    "scripts",
    "slurm",
    "examples",
    "tests",
)
"""The folders whose ``.py`` and ``.yaml`` files may cite a page (every tracked folder but ``docs/``)."""
TEXT_SUFFIXES = frozenset({".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".sbatch", ".txt", ".cfg", ".ini"})
UPSTREAM_PAGES = frozenset({"docs/legacy.md", "docs/README_Hybrid-EP.md"})
"""Pages of other projects' repositories that sources cite for a number (DeepEP's, Hybrid-EP's)."""
CITATION = re.compile(r"\b((?:docs/[\w./-]+|README)\.md)\b(?:,?\s+(?:\"([^\"\n]+)\"|'([^'\n]+)'))?")


def pages() -> list[Path]:
    """The Markdown files whose links are checked."""
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's Markdown text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags are not part of the text
    text = html.unescape(text).lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link may name in ``path``: its headings' slugs (de-duplicated) and HTML anchors."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(path.read_text()):
        out.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link of ``path`` (web links, mail and bare anchors of other
    schemes left out)."""
    out = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue
            out.append((number, target))
    return out


def broken_links(path: Path) -> list[str]:
    """One line per link of ``path`` that names no file or no heading."""
    bad = []
    for number, target in links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no file {dest})")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(REPO)})")
    return bad


def test_every_relative_link_in_the_docs_resolves() -> None:
    bad = [line for path in pages() for line in broken_links(path)]
    assert not bad, "\n".join(bad)


def test_every_manual_page_is_under_the_limit() -> None:
    docs = REPO / "docs"
    manual = [
        p for p in sorted(docs.rglob("*.md")) if p.relative_to(docs).parts[0] not in {"records", "results"}
    ]
    assert manual, "no manual pages found under docs/"
    long = {
        str(p.relative_to(REPO)): n
        for p in manual
        if (n := len(p.read_text().splitlines())) >= MAX_MANUAL_LINES
    }
    assert not long, (
        f"manual pages of {MAX_MANUAL_LINES} lines or more (move records to docs/records/): {long}"
    )


def test_every_manual_page_opens_with_what_it_is_for() -> None:
    """After its title, each manual page opens with a paragraph of prose (what it is for, how to use it)."""
    docs = REPO / "docs"
    missing = []
    for p in sorted(docs.rglob("*.md")):
        if p.relative_to(docs).parts[0] in {"records", "results"}:
            continue
        lines = [ln for ln in p.read_text().splitlines() if ln.strip()]
        if len(lines) < 2 or not lines[0].startswith("# ") or lines[1].startswith(("#", "|", "```", "<!--")):
            missing.append(str(p.relative_to(REPO)))
    assert not missing, f"pages that do not open with a paragraph under their title: {missing}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("`make reproduce-paper`: the paper's six grids", "make-reproduce-paper-the-papers-six-grids"),
        ("Grid runner (`benchmarks/bench_reproduce.py`)", "grid-runner-benchmarksbench_reproducepy"),
        (
            "Check rows: |model / published - 1| (target: median &lt;= 15 %)",
            "check-rows-model--published---1-target-median--15-",
        ),
        ("EPLB+, LPLB+, PopFetcher", "eplb-lplb-popfetcher"),
    ],
)
def test_slug_follows_githubs_rule(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_link_and_a_missing_anchor_are_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-section) [gone](c.md) [no anchor](b.md#nothing) [web](https://x.org/y) `[code](z.md)`\n"
        "```\n[fenced](z.md)\n```\n"
    )
    bad = broken_links(page)
    assert len(bad) == 2 and "c.md" in bad[0] and "#nothing" in bad[1], bad


def source_files(root: Path, suffixes: frozenset[str] | set[str]) -> list[Path]:
    """The files under ``SOURCE_ROOTS`` of ``root`` whose suffix is in ``suffixes`` (no ``__pycache__``)."""
    return sorted(
        p
        for name in SOURCE_ROOTS
        for p in (root / name).rglob("*")
        if p.is_file() and p.suffix in suffixes and "__pycache__" not in p.parts
    )


def design_note_citations(root: Path) -> list[str]:
    """``path:line`` of every line that names ``DESIGN_NOTES`` in the sources, ``docs/`` and the top-level
    text files of ``root``, ``CHANGELOG.md`` (history) left out."""
    files = [*source_files(root, TEXT_SUFFIXES), *sorted((root / "docs").rglob("*.md"))]
    files += [
        p
        for p in sorted(root.iterdir())
        if p.is_file() and (p.suffix in TEXT_SUFFIXES or p.name == "Makefile")
    ]
    return [
        f"{p.relative_to(root)}:{number}"
        for p in files
        if p.name != "CHANGELOG.md"
        for number, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if DESIGN_NOTES in line
    ]


def titles(page: Path) -> list[str]:
    """What a citation's quoted title may name in ``page``: each heading and each table row's first cell,
    inline code unwrapped."""
    out = []
    for line in prose_lines(page.read_text()):
        m = HEADING.match(line)
        text = (
            m.group(2)
            if m
            else line.strip().strip("|").split("|")[0]
            if line.lstrip().startswith("|")
            else ""
        )
        if text.strip():
            out.append(INLINE_CODE.sub(lambda c: c.group(2), text).strip())
    return out


def broken_citations(root: Path) -> list[str]:
    """One line per page citation of a ``.py`` or ``.yaml`` file under ``root`` that names no file, or a
    title that no heading or table row of the page starts with (case aside)."""
    bad = []
    for path in source_files(root, {".py", ".yaml", ".yml"}):
        for m in CITATION.finditer(path.read_text()):
            if m.group(1) in UPSTREAM_PAGES:
                continue
            page, title = root / m.group(1), m.group(2) or m.group(3)
            where = f"{path.relative_to(root)}: {m.group(0).strip()!r}"
            if not page.is_file():
                bad.append(f"{where} (no file {m.group(1)})")
            elif title and not any(t.lower().startswith(title.lower()) for t in titles(page)):
                bad.append(f"{where} (no heading or table row of {m.group(1)} starts with {title!r})")
    return bad


def test_nothing_cites_the_design_notes_outside_the_repository() -> None:
    bad = design_note_citations(REPO)
    assert not bad, f"cite docs/glossary.md or the docs page instead of {DESIGN_NOTES}: {bad}"


def test_every_page_a_docstring_or_yaml_comment_names_exists() -> None:
    bad = broken_citations(REPO)
    assert not bad, "\n".join(bad)


def test_a_bad_citation_is_named(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "# Page\n\nWhat it is for.\n\n## A section (`x`)\n\n"
        "| term | meaning |\n|---|---|\n| `load` | tokens |\n"
    )
    (tmp_path / "relibra").mkdir()
    page, gone = "docs" + "/page.md", "docs" + "/none.md"  # built, so this file cites neither
    (tmp_path / "relibra" / "m.py").write_text(
        f'"""See {page}, "A section"; {page}, "load"; {page}, "Gone"; {gone}."""\n# {DESIGN_NOTES}\n'
    )
    (tmp_path / "CHANGELOG.md").write_text(f"cited {DESIGN_NOTES} once\n")
    bad = broken_citations(tmp_path)
    assert len(bad) == 2 and "'Gone'" in bad[0] and f"no file {gone}" in bad[1], bad
    assert design_note_citations(tmp_path) == ["relibra/m.py:2"]
