"""The per-layer check and Hopper calibration (experiments/validation/moe_layer.py, ``validate
--moe-layer``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.config.errors import ConfigError
from experiments.validation.cli import main as validate_main
from experiments.validation.moe_layer import (
    DATA_FILE,
    FITTED,
    POST_SYNC,
    fit_layer,
    load_layer_rows,
    price_layer,
)

CONF = Path(__file__).resolve().parents[2] / "experiments" / "conf" / "cluster"


def _row(role: str = "calibration", **extra: object) -> dict:
    doc = load_layer_rows()
    row = copy.deepcopy(next(r for r in doc["rows"] if r["id"] == "mixtral/h100x8/bf16/a2a/ep8"))
    row.update(role=role, **extra)
    return row


def test_roles_fixed_bf16_calibrates_fp8_checks() -> None:
    rows = load_layer_rows()["rows"]
    assert len(rows) == 12
    assert {r["id"] for r in rows if r["role"] == "calibration"} == {
        r["id"] for r in rows if "/bf16/" in r["id"]
    }


def test_pricing_never_reads_the_measurement() -> None:
    a, b = _row(), _row(forward_ms=1e6, backward_ms=1e-6)
    pa, pb = price_layer(a), price_layer(b)
    assert (pa.forward_s, pa.backward_s) == (pb.forward_s, pb.backward_s)


def test_terms_add_up_and_host_time_is_one_per_direction() -> None:
    row = _row()
    p0 = price_layer(row, {FITTED[1]: 0.0})
    p1 = price_layer(row, {FITTED[1]: 1e-3})
    assert p0.forward_s + p0.backward_s == pytest.approx(sum(p0.terms.values()), rel=1e-12)
    assert p1.forward_s - p0.forward_s == pytest.approx(1e-3, rel=1e-9)
    assert p1.backward_s - p0.backward_s == pytest.approx(1e-3, rel=1e-9)
    # a faster GEMM makes the layer faster, and the backward holds two thirds of the GEMMs
    fast = price_layer(row, {FITTED[0]: 0.9, FITTED[1]: 0.0})
    assert fast.backward_s < p0.backward_s and fast.terms["experts"] < p0.terms["experts"]
    assert p0.backward_s > p0.forward_s


def test_force_balanced_expert_compute_matches_the_gemm_flops() -> None:
    """Mixtral proxy: 1 expert per GPU, 4096 x 2 x 8 / 8 = 8192 tokens, SwiGLU 3 matrices, fwd + bwd."""
    row = _row()
    p = price_layer(row, {FITTED[0]: 0.7, FITTED[1]: 0.0})
    n, h, f = 8192, 4096, 14336
    flops = 3 * 2 * 3 * h * f * n
    assert p.terms["experts"] == pytest.approx(flops * (n + 128) / n / (989e12 * 0.7), rel=1e-9)


def _synthetic(host: float) -> dict:
    """The data file with every calibration row's measurement replaced by the model's own at ``host``."""
    doc = copy.deepcopy(load_layer_rows())
    for row in doc["rows"]:
        p = price_layer(row, {FITTED[1]: host})
        row["forward_ms"], row["backward_ms"] = p.forward_s * 1e3, p.backward_s * 1e3
    return doc


def test_the_fit_recovers_a_known_host_time_and_ignores_check_rows() -> None:
    doc = _synthetic(4e-4)
    fit = fit_layer(doc)
    assert fit.host_overhead_s == pytest.approx(4e-4, rel=1e-4)
    assert fit.log_rms < 1e-6 and np.isnan(fit.gemm_efficiency)
    for row in doc["rows"]:
        if row["role"] == "check":
            row["forward_ms"], row["backward_ms"] = 1e3, 1e3
    assert fit_layer(doc).host_overhead_s == fit.host_overhead_s


def test_the_post_sync_fit_is_stored_apart_from_the_yamls() -> None:
    """The rows identify the isolated layer's post-sync host time only (module doc): it is stored in the
    data file, and no cluster yaml takes it; Hopper's step host time is Blackwell's, borrowed (the yaml
    says so)."""
    doc = load_layer_rows()
    stored = doc["fitted_constants"][POST_SYNC]
    assert stored["rows"] == [r["id"] for r in doc["rows"] if r["role"] == "calibration"]
    assert set(doc["fitted_constants"]) == {POST_SYNC}
    blackwell = float(OmegaConf.load(CONF / "b200.yaml").hardware.host_overhead_s)
    for name in ("hopper", "h800"):
        text = (CONF / f"{name}.yaml").read_text()
        assert float(OmegaConf.load(CONF / f"{name}.yaml").hardware.host_overhead_s) == blackwell, name
        assert "Borrowed from Blackwell" in text, name


def test_the_stored_value_is_what_the_fit_gives() -> None:
    stored = load_layer_rows()["fitted_constants"][POST_SYNC]
    fit = fit_layer(load_layer_rows())
    assert fit.host_overhead_s == pytest.approx(stored["value"], abs=1e-12)
    assert round(fit.log_rms, 6) == stored["log_rms"]


def test_the_layer_is_priced_without_the_step_host_time() -> None:
    row = _row()
    assert price_layer(row).terms["host"] == 0.0
    assert price_layer(row, {FITTED[1]: 1e-3}).terms["host"] == pytest.approx(2e-3)


def test_bad_data_file_is_one_message_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "layer.json"
    bad.write_text("{not json")
    assert validate_main(["--moe-layer", "--data", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err
    doc = json.loads(DATA_FILE.read_text())
    doc["rows"][0]["role"] = "tuning"
    bad.write_text(json.dumps(doc))
    assert validate_main(["--moe-layer", "--data", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "role" in err and len(err.strip().splitlines()) == 1
    del doc["rows"][0]["model"]
    doc["rows"][0]["role"] = "check"
    bad.write_text(json.dumps(doc))
    assert validate_main(["--moe-layer", "--data", str(bad)]) == 2
    assert "model" in capsys.readouterr().err


def test_the_check_rows_stay_within_the_recorded_error() -> None:
    """The FP8 check rows, priced with nothing fitted to them: within 15 % each (13.3 % worst when the
    roles were fixed and the host fitted; docs/validation.md). A cost-model change that moves them past
    that must say why."""
    doc = load_layer_rows()
    for row in doc["rows"]:
        if row["role"] != "check":
            continue
        p = price_layer(row)
        ratio = (p.forward_s + p.backward_s) * 1e3 / (row["forward_ms"] + row["backward_ms"])
        assert abs(ratio - 1.0) < 0.15, (row["id"], ratio)


def test_a_measured_load_is_priced_on_the_static_placement() -> None:
    """routing.load: the uniform load gives the force-balanced price; a hot expert costs its GPU more."""
    row = _row()
    uniform = [[4096 * 2 / 8] * 8 for _ in range(8)]
    balanced = price_layer(row)
    same = price_layer({**row, "routing": {"load": uniform}})
    assert (same.forward_s, same.backward_s) == pytest.approx((balanced.forward_s, balanced.backward_s))
    hot = [[1024.0 * 2] + [1024.0 * 6 / 7] * 7 for _ in range(8)]  # expert 0 takes a quarter of the slots
    skewed = price_layer({**row, "routing": {"load": hot}})
    assert skewed.terms["experts"] > balanced.terms["experts"] * 1.9
    assert skewed.backward_s > balanced.backward_s
    with pytest.raises(ConfigError, match=r"routing\.load"):
        price_layer({**row, "routing": {"load": [[1.0] * 8]}})
