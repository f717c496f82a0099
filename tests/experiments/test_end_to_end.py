"""The end-to-end validation's data and its rules (experiments/validation/end_to_end.py): every row is a
sourced measurement with a role fixed before any fit, only calibration rows may be fitted to, and no check
row's published value reaches the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from experiments.validation.end_to_end import (
    DATA_FILE,
    ROLES,
    check_roles,
    end_to_end_table,
    errors,
    load_rows,
    simulate_row,
)

FIELDS = ("id", "source", "url", "date", "config", "metric", "value", "unit", "role", "overrides")


def test_every_row_is_a_sourced_measurement_with_a_role() -> None:
    doc = load_rows()
    ids = [r["id"] for r in doc["rows"]]
    assert len(ids) == len(set(ids))
    for row in doc["rows"]:
        assert all(k in row for k in FIELDS), row["id"]
        assert row["role"] in ROLES and row["url"].startswith("https://github.com/")
        assert row["value"] > 0 and row["unit"] == "tokens/s/GPU"
        assert row.get("needs") or row["overrides"], row["id"]  # a simulated row says how it is simulated
    # the issue's own example: Qwen3-30B-A3B on 16 H100s, EP 16, is a check row
    assert doc["rows"][0]["config"]["gpus"] == 16 and doc["rows"][0]["role"] == "check"
    for fit in doc["fitted_constants"].values():
        assert all(next(r for r in doc["rows"] if r["id"] == i)["role"] == "calibration" for i in fit["rows"])


def test_a_fit_to_a_check_row_is_refused() -> None:
    doc = {"rows": [{"id": "a", "role": "check"}, {"id": "b", "role": "calibration"}]}
    check_roles({**doc, "fitted_constants": {"training.host_overhead_s": {"value": 1e-3, "rows": ["b"]}}})
    with pytest.raises(ValueError, match="uses row 'a', whose role is 'check'"):
        check_roles(
            {**doc, "fitted_constants": {"training.host_overhead_s": {"value": 1e-3, "rows": ["a", "b"]}}}
        )
    with pytest.raises(ValueError, match="uses row 'z', whose role is None"):
        check_roles({**doc, "fitted_constants": {"training.host_overhead_s": {"value": 1e-3, "rows": ["z"]}}})
    with pytest.raises(ValueError, match=re.escape("expected {'value': number, 'rows': [row ids]}")):
        check_roles({**doc, "fitted_constants": {"training.host_overhead_s": ["b"]}})
    with pytest.raises(ValueError, match="role='guess'"):
        check_roles({"rows": [{"id": "c", "role": "guess"}]})


def test_a_check_rows_value_does_not_reach_the_model() -> None:
    row = next(r for r in load_rows()["rows"] if r["role"] == "check" and not r.get("needs"))
    assert simulate_row(row) == simulate_row({**row, "value": row["value"] * 3.0})


@pytest.mark.slow
def test_perturbed_check_values_leave_every_model_value_unchanged(tmp_path: Path) -> None:
    doc = json.loads(DATA_FILE.read_text())
    for row in doc["rows"]:
        if row["role"] == "check":
            row["value"] *= 3.0
    path = tmp_path / "end_to_end.json"
    path.write_text(json.dumps(doc))
    ours, theirs = end_to_end_table(), end_to_end_table(path)
    pd.testing.assert_series_equal(ours.model, theirs.model)
    pd.testing.assert_series_equal(ours.model_unfitted, theirs.model_unfitted)
    assert (theirs.published[theirs.role == "check"] == 3 * ours.published[ours.role == "check"]).all()


def test_errors_are_the_check_rows_median_and_worst() -> None:
    table = pd.DataFrame(
        {
            "role": ["check", "check", "check", "calibration", "check"],
            "needs": ["", "", "", "", "parallel_dims"],
            "ratio": [1.1, 0.8, 1.05, 2.0, float("nan")],
        }
    )
    err = errors(table)
    assert err["rows"] == 3
    assert err["median"] == pytest.approx(0.1) and err["worst"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"overrides": ["cluster=hopper", "cluster.nodes=abc"]}, "cluster.nodes"),
        ({"overrides": ["cluster=nosuchcluster"]}, "nosuchcluster"),
        ({"config": {"gpus": 16}}, "missing field 'micro_batch'"),
    ],
)
def test_a_bad_row_is_refused_naming_the_file_and_the_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: dict, named: str
) -> None:
    """``--end-to-end --data``: a row whose configuration cannot run is one message naming the data file,
    the row and the problem, exit status 2 (no traceback)."""
    from experiments.validation.cli import main

    row = {**next(r for r in load_rows()["rows"] if not r.get("needs")), "id": "user/row"}
    row.update(change)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [row]}))
    assert main(["--end-to-end", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("validate: end-to-end data ") and str(path) in err and "'user/row'" in err
    assert named in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["{not json", '{"rows": 3}'])
def test_an_unreadable_data_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    from experiments.validation.cli import main

    path = tmp_path / "rows.json"
    path.write_text(text)
    assert main(["--end-to-end", "--data", str(path)]) == 2
    assert str(path) in capsys.readouterr().err
    assert main(["--end-to-end", "--data", str(tmp_path / "missing.json")]) == 2


def test_generated_tables_hold_every_row_and_the_errors(tmp_path: Path) -> None:
    """``--write-tables``: one table row per data row, the errors table equal to :func:`errors`, and a
    generated block of docs/records/validation.md reads its numbers back (analysis.docs_blocks)."""
    from analysis.docs_blocks import render_block
    from experiments.validation.end_to_end_tables import write_end_to_end_tables

    frame = pd.DataFrame(
        {
            "id": ["a/1", "b/2", "c/3"],
            "role": ["check", "check", "calibration"],
            "parallelism": ["ep", "pp/tp", "ep"],
            "published": [100.0, 200.0, 300.0],
            "model": [150.0, 180.0, 600.0],
            "ratio": [1.5, 0.9, 2.0],
            "step_time_s": [2.0, 3.0, 1.0],
            "t_fp8_cast_s": [0.25, 0.0, 0.5],
            "needs": ["", "", ""],
        }
    )
    paths = write_end_to_end_tables(frame, tmp_path, "cmd")
    assert {p.name for p in paths} == {
        "end_to_end.md",
        "end_to_end.tex",
        "end_to_end_errors.md",
        "end_to_end_errors.tex",
    }
    assert render_block('end_to_end "FP8 casts s" row=a/1', tmp_path) == "0.25"
    assert render_block('end_to_end "model / published"', tmp_path) == "0.90-2.00"
    assert render_block('end_to_end_errors "median %" set=all', tmp_path) == "30"  # |0.5| and |-0.1|: 0.3
    assert render_block('end_to_end_errors "worst %" set=all', tmp_path) == "50"
    assert render_block('end_to_end_errors "check rows" "set=EP only"', tmp_path) == "1"
    # with fitted constants: the columns before the fit, and a second set of errors beside the first
    fitted = frame.assign(model_unfitted=[110.0, 190.0, 330.0], ratio_unfitted=[1.1, 0.95, 1.1])
    fit = {
        "training.host_overhead_s": {
            "value": 0.0035,
            "rows": ["c/3"],
            "log_rms": 0.2,
            "leave_one_out": [3e-3, 4e-3],
        }
    }
    paths = write_end_to_end_tables(fitted, tmp_path, "cmd", fit)
    assert {p.name for p in paths} >= {"end_to_end_fit.md", "end_to_end_fit.tex"}
    assert render_block('end_to_end_fit "value" constant=training.host_overhead_s', tmp_path) == "0.0035"
    assert render_block('end_to_end_fit "leave-one-out hi"', tmp_path) == "0.004"
    assert render_block('end_to_end "before the fit / published" row=a/1', tmp_path) == "1.10"
    assert render_block('end_to_end_errors "median %" set=all "constants=before the fit"', tmp_path) == "8"
    assert render_block('end_to_end_errors "median %" set=all constants=experiments/conf', tmp_path) == "30"
    assert "`cmd`" in (tmp_path / "end_to_end.md").read_text()
