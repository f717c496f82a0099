"""The end-to-end fit (experiments/validation/end_to_end_fit.py): it finds a known minimum, reads the
calibration rows only, refuses data it cannot fit, and the stored value is what the fit gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from experiments.validation.end_to_end import DATA_FILE, load_rows, unfitted_overrides
from experiments.validation.end_to_end_fit import FITTED, fit_host_overhead, minimise_log_error


def test_the_minimum_of_rows_that_one_value_fits_exactly_is_that_value() -> None:
    inv0, slope = np.array([1e-4, 3e-4, 2e-5]), np.array([0.02, 0.5, 0.001])
    target = inv0 + slope * 0.0042
    assert minimise_log_error(inv0, slope, target, upper=0.1) == pytest.approx(0.0042, rel=1e-8)


def test_rows_already_too_slow_fit_zero() -> None:
    inv0, slope = np.array([2e-4, 3e-4]), np.array([0.02, 0.5])
    assert minimise_log_error(inv0, slope, inv0 / 1.5, upper=0.1) == 0.0


def test_the_minimum_balances_rows_in_log_space() -> None:
    """Two rows on the same line whose published values differ by 2x: the error is least where the model
    is as far above one as below the other in log space, 1 + 1000 h = sqrt(2 * 4)."""
    inv0, slope = np.array([1.0, 1.0]), np.array([1000.0, 1000.0])
    h = minimise_log_error(inv0, slope, np.array([2.0, 4.0]), upper=0.01)
    assert h == pytest.approx((np.sqrt(8.0) - 1.0) / 1000.0, rel=1e-8)


def _doc() -> dict[str, Any]:
    row = {"config": {}, "overrides": [], "unit": "tokens/s/GPU"}
    return {
        "rows": [
            {**row, "id": "cal/a", "role": "calibration", "value": 1.0 / (1e-4 + 0.02 * 0.003)},
            {**row, "id": "cal/b", "role": "calibration", "value": 1.0 / (3e-4 + 0.5 * 0.003)},
            {**row, "id": "check/c", "role": "check", "value": 123.0},
            {**row, "id": "cal/graphed", "role": "calibration", "value": 1.0 / 1e-4},
        ]
    }


_LINES = {"cal/a": (1e-4, 0.02), "cal/b": (3e-4, 0.5), "check/c": (1e-4, 1.0), "cal/graphed": (1e-4, 0.0)}


def _fake(seen: list[str]) -> Any:
    """A simulator whose rows' seconds per token are the lines of ``_LINES`` in the fitted constant."""

    def simulate(row: dict[str, Any], constants: tuple[str, ...]) -> dict[str, float]:
        seen.append(row["id"])
        (h,) = [float(c.split("=", 1)[1]) for c in constants if c.startswith(FITTED + "=")]
        inv0, slope = _LINES[row["id"]]
        return {"model": 1.0 / (inv0 + slope * h)}

    return simulate


def test_the_fit_reads_only_calibration_rows_and_finds_their_value() -> None:
    seen: list[str] = []
    fit = fit_host_overhead(_doc(), simulate=_fake(seen))
    assert "check/c" not in seen and set(seen) == {"cal/a", "cal/b", "cal/graphed"}
    assert fit.rows == ("cal/a", "cal/b", "cal/graphed")
    assert fit.value == pytest.approx(0.003, rel=1e-6)
    assert fit.ratios == pytest.approx((1.0, 1.0, 1.0), rel=1e-6) and fit.log_rms < 1e-6
    assert fit.ratios_before[1] == pytest.approx((3e-4 + 0.5 * 0.003) / 3e-4)
    assert fit.leave_one_out == pytest.approx((0.003, 0.003, 0.003), rel=1e-6)  # the rows agree
    # the check row's published value is not read: changing it changes nothing
    doc = _doc()
    doc["rows"][2]["value"] = 1e9
    assert fit_host_overhead(doc, simulate=_fake([])) == fit


def test_leaving_out_a_row_gives_the_value_of_the_others() -> None:
    """Two rows on one line (1 + 1000 h seconds per token) published at 2 and 4: each alone is fitted
    exactly (1 ms, 3 ms), both together between them."""
    row = {"config": {}, "overrides": [], "unit": "tokens/s/GPU", "role": "calibration"}
    doc = {"rows": [{**row, "id": "two", "value": 0.5}, {**row, "id": "four", "value": 0.25}]}

    def simulate(r: dict[str, Any], constants: tuple[str, ...]) -> dict[str, float]:
        (h,) = [float(c.split("=", 1)[1]) for c in constants]
        return {"model": 1.0 / (1.0 + 1000.0 * h)}

    fit = fit_host_overhead(doc, simulate=simulate)
    assert fit.value == pytest.approx((np.sqrt(8.0) - 1.0) / 1000.0, rel=1e-8)
    assert fit.leave_one_out == pytest.approx((0.003, 0.001), rel=1e-8)  # without "two": "four" alone
    assert fit.entry()["leave_one_out"] == pytest.approx([0.001, 0.003], rel=1e-8)


def test_a_fit_without_calibration_rows_or_without_dependence_is_refused() -> None:
    doc = _doc()
    with pytest.raises(ValueError, match="no simulated calibration rows"):
        fit_host_overhead({"rows": [doc["rows"][2]]}, simulate=_fake([]))
    with pytest.raises(ValueError, match="no calibration row depends on it"):
        fit_host_overhead({"rows": [doc["rows"][3]]}, simulate=_fake([]))


def test_the_stored_fit_names_calibration_rows_and_is_undone_as_an_override() -> None:
    doc = load_rows()
    fit = doc["fitted_constants"][FITTED]
    calibration = [r["id"] for r in doc["rows"] if r["role"] == "calibration" and not r.get("needs")]
    assert fit["rows"] == calibration and fit["value"] > 0
    assert unfitted_overrides(doc) == (f"{FITTED}=0.0",)


BLACKWELL = ("b200", "b300", "gb200", "gb300", "gb200-nvl72")
"""The cluster yamls of the generation the end-to-end calibration rows ran on (B200 / B300)."""
HOPPER = ("hopper", "h800")


def test_experiments_conf_runs_the_fitted_value_borrowed_on_hopper() -> None:
    """Each Blackwell cluster yaml carries the stored fit at the 4 digits the yaml keeps (a re-fit that
    moves the value must move them with it, and re-run the tables); the training default is null (the
    generation's own). Hopper borrows it, and its yamls say so (no Hopper measurement identifies it:
    tests/experiments/test_moe_layer.py)."""
    from omegaconf import OmegaConf

    conf_dir = DATA_FILE.parents[1] / "conf"
    stored = load_rows()["fitted_constants"][FITTED]["value"]
    assert OmegaConf.load(conf_dir / "training" / "megatron.yaml").host_overhead_s is None
    for name in BLACKWELL:
        hw = OmegaConf.load(conf_dir / "cluster" / f"{name}.yaml").hardware
        assert float(hw.host_overhead_s) == float(f"{stored:.4g}") > 0, name
    for name in HOPPER:
        hw = OmegaConf.load(conf_dir / "cluster" / f"{name}.yaml").hardware
        assert float(hw.host_overhead_s) == float(f"{stored:.4g}"), name
        assert "Borrowed from Blackwell" in (conf_dir / "cluster" / f"{name}.yaml").read_text(), name


@pytest.mark.slow
def test_the_stored_value_is_what_the_fit_gives() -> None:
    """Re-fit on the committed rows (about 80 s): the same value and rows as stored."""
    doc = load_rows()
    fit = fit_host_overhead(doc)
    stored = doc["fitted_constants"][FITTED]
    assert fit.value == pytest.approx(stored["value"], rel=1e-9)
    assert list(fit.rows) == stored["rows"] and round(fit.log_rms, 6) == stored["log_rms"]
    assert fit.entry()["leave_one_out"] == pytest.approx(stored["leave_one_out"], rel=1e-9)


def test_fit_from_the_command_line_stores_the_value_and_keeps_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--end-to-end --fit --data FILE`` on one calibration row (the 8-GPU B200 Qwen3-30B-A3B run marked
    calibration here, only for the test): the value is stored in FILE, every other field kept, and the
    table prints both sets of errors."""
    from experiments.validation.cli import main

    doc = json.loads(DATA_FILE.read_text())
    row = next(r for r in doc["rows"] if r["id"] == "qwen3-30b-a3b/b200x8/mxfp8/ep8/26.04.01")
    mine = {"provenance": "test", "fitted_constants": {}, "rows": [{**row, "role": "calibration"}]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(mine))
    assert main(["--end-to-end", "--fit", "--data", str(path)]) == 0
    out = capsys.readouterr().out
    stored = json.loads(path.read_text())
    fit = stored["fitted_constants"][FITTED]
    assert fit["rows"] == [row["id"]] and fit["value"] > 0 and fit["log_rms"] < 1e-3  # one row: exact
    assert stored["rows"] == mine["rows"] and stored["provenance"] == "test"
    errors = out.split("with the fitted ones at 0", 1)[1].splitlines()
    assert any(line.split()[:4] == ["experiments/conf", "all", "0", "NaN"] for line in errors)
    assert any(line.split()[:6] == ["before", "the", "fit", "all", "0", "NaN"] for line in errors)


def test_fit_without_end_to_end_or_with_nothing_to_fit_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.validation.cli import main

    assert main(["--fit"]) == 2
    assert "--fit, --data and --write-tables go with --end-to-end" in capsys.readouterr().err
    doc = json.loads(DATA_FILE.read_text())
    checks = {"fitted_constants": {}, "rows": [r for r in doc["rows"] if r["role"] == "check"][:1]}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(checks))
    assert main(["--end-to-end", "--fit", "--data", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no simulated calibration rows" in err and "Traceback" not in err
    assert json.loads(path.read_text()) == checks  # nothing written
