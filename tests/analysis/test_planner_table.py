"""The planner table of the docs is the registry's: committed up to date, embedded in the README, and named
by ``--check-docs`` when stale."""

from __future__ import annotations

from pathlib import Path

import pytest

from analysis.__main__ import DOCS_RESULTS, REPO, main
from analysis.docs_blocks import BLOCK
from analysis.planner_table import planner_table, planner_table_problem, write_planner_table
from relibra.planners.registry import CARDS


def test_every_card_is_one_row_in_registry_order() -> None:
    rows = [
        ln
        for ln in planner_table().splitlines()
        if ln.startswith("| `") and not ln.startswith("| `planner=`")
    ]
    assert [r.split("`")[1] for r in rows] == [c.name for c in CARDS]
    moonep = next(r for r in rows if r.startswith("| `moonep`"))
    assert moonep == "| `moonep` | MoonEP | online | `routed_microbatch` | `baselines.moonep.MoonEPPlanner` |"


def test_the_committed_table_and_the_readme_block_are_the_registry_s() -> None:
    assert planner_table_problem(DOCS_RESULTS) is None
    blocks = [m for m in BLOCK.finditer((REPO / "README.md").read_text()) if m.group("spec") == "planners"]
    assert len(blocks) == 1
    assert blocks[0].group("body") == "\n" + planner_table().rstrip("\n") + "\n"


def test_a_stale_or_missing_table_is_named_and_rewritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "missing" in (planner_table_problem(tmp_path) or "")
    (tmp_path / "planners.md").write_text(planner_table().replace("MoonEP", "MoonEP (old)"))
    assert main(["--check-docs", "--tables", str(tmp_path)]) == 1
    assert f"{tmp_path / 'planners.md'}: differs from the planner registry" in capsys.readouterr().err
    assert write_planner_table(tmp_path) and not write_planner_table(tmp_path)
    assert planner_table_problem(tmp_path) is None
