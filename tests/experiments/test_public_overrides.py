"""Every planner override the README lists works for every planner it names: composed, checked, built.

The rows come from the README's "Which planner takes which key" table (the ``planner-keys`` marker), so the
README and this test cannot drift apart; every field of every baseline's dataclass is overridden too, as the
README's ``planner.KEY=V`` (baselines) row promises.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from experiments.config.build import build_planner
from experiments.config.checks import check_config
from experiments.config.planner_nodes import NODES
from experiments.config.presets import CONF_DIR
from experiments.config.spec import build_spec
from tests.builders import cfg

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- planner-keys: the test reads this table -->"
SHAPE = ("model=olmoe-1b-7b", "cluster.nodes=1", "trace.num_batches=1", "trace.samples_per_batch=16")
"""A small run (64 experts on 8 GPUs) every planner accepts: the override is what is checked."""


def readme_rows() -> list[tuple[str, list[str]]]:
    """(override, planners) of every row of the README's planner-keys table."""
    lines = README.read_text().splitlines()
    start = lines.index(MARKER) + 3  # NOTE: the marker, the header row, the separator row
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        override, planners = (re.findall(r"`([^`]+)`", cell) for cell in line.strip("|").split("|")[:2])
        rows.append((override[0], planners))
    return rows


ROWS = readme_rows()
PAIRS = [(override, planner) for override, planners in ROWS for planner in planners]


def test_the_readme_table_has_rows() -> None:
    assert len(ROWS) >= 10 and all(planners for _, planners in ROWS)
    assert ("planner.candidates.balance.reorder.horizon=12", ["relibra_portfolio"]) in ROWS


@pytest.mark.parametrize(("override", "planner"), PAIRS)
def test_each_listed_override_works_for_each_listed_planner(override: str, planner: str) -> None:
    composed = cfg(f"planner={planner}", override, *SHAPE)
    check_config(composed)
    build_planner(build_spec(composed))
    key, value = override.split("=", 1)
    assert OmegaConf.select(composed, key) == yaml.safe_load(value)


def test_the_portfolio_refuses_the_plain_reorder_key_the_readme_sends_elsewhere() -> None:
    with pytest.raises(Exception, match=r"reorder"):
        cfg("planner=relibra_portfolio", "planner.reorder.horizon=12", *SHAPE)


def _render(value: Any) -> str:
    """``value`` as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_render(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"
    return repr(value)


BASELINE_TARGETS = {
    f"{c.__module__}.{c.__qualname__}": c for (g, _), c in NODES.items() if g == "planner/base"
}
"""``_target_`` -> the dataclass of every baseline node."""


def baseline_planners() -> list[str]:
    out = []
    for path in sorted((CONF_DIR / "planner").glob("*.yaml")):
        target = OmegaConf.select(cfg(f"planner={path.stem}").planner, "_target_")
        if target in BASELINE_TARGETS:
            out.append(path.stem)
    return out


@pytest.mark.parametrize("planner", baseline_planners())
def test_every_field_of_a_baselines_dataclass_is_an_override(planner: str) -> None:
    node = cfg(f"planner={planner}").planner
    settings = BASELINE_TARGETS[str(node._target_)]
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    overrides = [f"planner.{f.name}={_render(values[f.name])}" for f in fields(settings)]
    composed = cfg(f"planner={planner}", *overrides, *SHAPE)
    check_config(composed)
    built = build_planner(build_spec(composed))
    for f in fields(settings):
        got = getattr(built, f.name)
        assert (list(got) if isinstance(got, tuple) else got) == values[f.name], f.name
