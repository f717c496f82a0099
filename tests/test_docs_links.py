"""The docs as a manual: every relative link resolves, and every manual page stays short.

Links: every relative Markdown link of ``README.md``, ``CHANGELOG.md`` and ``docs/**/*.md`` names a file that
exists and, where it has an ``#anchor``, a heading of that file, by GitHub's slug rule (lower case; every
character that is not a letter, a digit, a space, ``-`` or ``_`` dropped; spaces to ``-``; a repeated slug
gets ``-1``, ``-2``, ...). Fenced code and inline code are not read. Length: a page of ``docs/`` outside
``docs/records/`` (dated measurements) and ``docs/results/`` (generated tables) stays under
``MAX_MANUAL_LINES`` lines (issue 57: "every page ... stays under about 400 lines").
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
