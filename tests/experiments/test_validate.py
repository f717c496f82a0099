"""The calibration of link rates against DeepEP's tables and the validation table (experiments.validate)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.validation import cli, kernels
from relibra.cost.linkrates import benchmark_volumes, fit_rates, load_points, predicted_bandwidth

CALIBRATION_TOLERANCE = 0.05
"""Each calibration point is reproduced within 5 % by the rates in the cluster files."""
FIT_TOLERANCE = 0.01
"""The cluster files' achievable rates are the fit, rounded within 1 %."""


@pytest.fixture(scope="module")
def fitted():
    points = load_points(kernels.DATA / "deepep_bandwidth.json")
    vols = [benchmark_volumes(p) for p in points]
    return points, vols, fit_rates(points, vols, "H800")


def test_cluster_files_carry_the_fitted_rates(fitted):
    _, _, rates = fitted
    for name in ("hopper", "h800"):
        hw = kernels._hardware(name)
        assert hw.nic_bytes_per_s * hw.nic_efficiency == pytest.approx(rates["rdma"], rel=FIT_TOLERANCE)
    h800 = kernels._hardware("h800")
    assert h800.nvlink_bytes_per_s * h800.nvlink_efficiency == pytest.approx(
        rates["nvlink"], rel=FIT_TOLERANCE
    )
    # the achievable rate lies below line rate, and the fit is no assumed 80 %
    assert 0.8 < rates["rdma"] / 50e9 < 1.0


def test_calibration_points_within_tolerance(fitted):
    points, vols, rates = fitted
    calib = [(p, v) for p, v in zip(points, vols, strict=True) if p.role == "calibration"]
    assert len(calib) == 10
    for p, v in calib:
        nvl = rates["nvlink"] * (450 / 200 if p.gpu == "H100" else 1.0)
        got = predicted_bandwidth(v, nvl, rates["rdma"])
        assert got == pytest.approx(p.reported_gb_s, rel=CALIBRATION_TOLERANCE), (p, got)


def test_benchmark_volumes_match_hand_counts():
    # Hybrid-EP's uniform router at 32 ranks of 8 experts: a token misses a node of 64 of 256 experts with
    # probability C(192, 8) / C(256, 8); logical = nodes reached (own included), RDMA = remote ones.
    points = [
        p for p in load_points(kernels.DATA / "deepep_bandwidth.json") if p.impl == "hybrid-ep" and p.ep == 32
    ]
    vol = benchmark_volumes(points[0], tokens=1024)
    miss = np.prod([(192 - i) / (256 - i) for i in range(8)])
    assert vol.logical / 4096 == pytest.approx(4 * (1 - miss), rel=0.02)
    assert vol.rdma / 4096 == pytest.approx(3 * (1 - miss), rel=0.03)


def test_validation_table_has_every_published_quantity():
    table, _ = kernels.validation_table()
    assert set(table.role) == {"calibration", "check"}
    assert (table.role == "calibration").sum() == 10
    assert np.isfinite(table.ratio).all() and (table.ratio > 0).all()
    assert table.quantity.str.startswith("V3 ").sum() == 7


def test_main_prints_the_table(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "calibration" in out and "check" in out and "fitted achievable rates" in out


def test_extract_profile_ties_kernels_to_annotations(tmp_path):
    ann = [
        {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": 100, "tid": 1}
        for name, ts in (("dispatch(F)", 0), ("mlp(F)", 200), ("combine(F)", 400), ("mlp(B)", 600),
                         ("dispatch(B)", 800), ("combine(B)", 1000))
    ]  # fmt: skip
    gemm = "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::m_grouped_fp8_ptp128c::GemmKernel>"
    launched = [
        ("void dpsk::ep::internode::dispatch<false, 8, false, 8>(int4*)", 10, 40.0),
        (
            gemm,
            210,
            7.0,
        ),
        (
            gemm,
            220,
            3.0,
        ),
        ("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16>(int4*)", 410, 60.0),
        (
            gemm,
            610,
            9.0,
        ),
        ("void dpsk::ep::internode::combine<false, 8, __nv_bfloat16>(int4*)", 810, 65.0),
        ("void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*)", 1010, 30.0),
        ("void other_kernel()", 1020, 99.0),
    ]
    events = list(ann)
    for i, (name, ts, dur) in enumerate(launched):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
                       "tid": 1, "args": {"correlation": i}})  # fmt: skip
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts + 5000, "dur": dur,
                       "args": {"correlation": i}})  # fmt: skip
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = kernels.extract_profile(path)["kernels_us"]
    assert got == {
        "dispatch_fwd": 40.0,
        "combine_fwd": 60.0,
        "dispatch_bwd": 30.0,
        "combine_bwd": 65.0,
        "grouped_gemm_fwd": 10.0,
        "grouped_gemm_dgrad": 9.0,
    }


def test_committed_profile_numbers_carry_provenance():
    prof = json.loads((kernels.DATA / "deepseek_v3_train_profile.json").read_text())
    assert "profile-data" in prof["provenance"] and prof["moe_layers"] == 4
    assert all(v > 0 for v in prof["kernels_us"].values())


ESTIMATE_TOLERANCE = 0.15
"""Per layer, the load-based DeepEP estimate stays within 15 % of exact routes on real traces (measured:
0.88-1.05 on olmoe-decode and flame-moe, docs/validation.md)."""


def test_deepep_estimate_against_exact_routes(shared_traces):
    if not (shared_traces / "olmoe-decode").is_dir():
        pytest.skip("olmoe-decode absent from the real traces")
    err = kernels.estimate_error_table(shared_traces)
    real = err[~err.routes.str.startswith("synthetic")]
    assert len(real) >= 3
    assert (real.ratio_min > 1 - ESTIMATE_TOLERANCE).all() and (real.ratio_max < 1 + ESTIMATE_TOLERANCE).all()
    uniform = err[err.routes.str.contains("uniform")]
    assert ((uniform.ratio_mean - 1).abs() < 0.06).all()
    # node-limited routing correlates a token's experts: independent slots overstate its RDMA at EP 64
    limited = err[err.routes.str.contains("4 nodes max") & (err["nodes x gpus"] == "8 x 8")]
    assert (limited.ratio_mean > 1.1).all()
