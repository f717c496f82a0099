"""The result columns: the typed step breakdown's fields are exactly the columns every run emits
(relibra.breakdown), each documented in docs/spine.md, and the per-layer table names its attention apart."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from baselines.eplb import EplbPlanner
from baselines.foremoe import ForeMoEPlanner
from baselines.llep import LlepPlanner
from baselines.megatron import MegatronPlanner
from baselines.ultraep import UltraEPPlanner
from relibra.breakdown import METRIC_COLUMNS, WHOLE_STEP_COLUMNS, StepBreakdown
from relibra.simulator import simulate
from tests.builders import tiny_setup

SPINE = Path(__file__).resolve().parents[1] / "docs" / "spine.md"


@pytest.fixture(scope="module")
def setup():
    return tiny_setup()


def test_the_breakdown_fields_are_the_metric_columns() -> None:
    assert tuple(f.name for f in fields(StepBreakdown)) == METRIC_COLUMNS
    assert WHOLE_STEP_COLUMNS[0] == "t_head_s" and WHOLE_STEP_COLUMNS[-1] == METRIC_COLUMNS[-1]
    assert {"t_comm_exposed_s", "t_comm_hidden_s", "redundant_slot_bytes"} <= set(METRIC_COLUMNS)


@pytest.mark.parametrize(
    "planner",
    [
        MegatronPlanner(),
        UltraEPPlanner(min_tokens_per_replica=1),
        LlepPlanner(),
        ForeMoEPlanner(replica_slots=2),
        EplbPlanner(redundant_slots=1),
    ],
    ids=lambda p: str(p.name),
)
def test_every_emitted_column_is_a_field(setup, planner) -> None:
    """A run's metrics are the breakdown's columns, in order, then its planner's stats (none a column)."""
    res = simulate(planner, *setup)
    keys = tuple(res.metrics)
    assert keys[: len(METRIC_COLUMNS)] == METRIC_COLUMNS
    assert {k: res.metrics[k] for k in METRIC_COLUMNS} == res.breakdown.columns()
    assert res.breakdown.step_time_s > 0.0


def test_every_metric_column_is_documented() -> None:
    """Each column appears in a row of docs/spine.md's "Result columns" table."""
    text = SPINE.read_text()
    table = text[text.index("### Result columns") : text.index("## The simulator")]
    documented = set(
        re.findall(r"`([a-z0-9_]+)`", "\n".join(ln for ln in table.splitlines() if ln.startswith("| `")))
    )
    assert set(METRIC_COLUMNS) <= documented, sorted(set(METRIC_COLUMNS) - documented)


def test_per_layer_attention_is_not_the_attention_column(setup) -> None:
    """The per-layer table holds one MoE layer's attention (``t_layer_attention_s``); the ``t_attention_s``
    column sums it over every (micro-batch, layer) and adds the dense layers."""
    counts, workload, cluster, model, cost = setup
    res = simulate(MegatronPlanner(), counts, workload, cluster, model, cost)
    table = res.per_layer()
    assert "t_layer_attention_s" in table.columns and "t_attention_s" not in table.columns
    per_step = table["t_layer_attention_s"].sum() / counts.num_batches
    dense_layers = model.num_layers - model.num_moe_layers
    assert dense_layers == 0  # the tiny model: the column is the per-layer sum alone
    assert res.metrics["t_attention_s"] == pytest.approx(per_step, rel=1e-12)
