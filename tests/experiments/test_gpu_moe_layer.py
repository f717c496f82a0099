"""scripts/gpu_moe_layer.py's dry run (CPU, gloo, two processes under torchrun) and its reader,
experiments/validation/gpu_measurements.py: every part runs or says why not, the routes have the skew asked
for, and the per-layer rows it yields are priced by ``python -m experiments.validate --moe-layer --data``."""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from experiments.validation import gpu_measurements as gm
from relibra.cost.calibration import load_calibration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_moe_layer.py"


@functools.cache
def _script() -> Any:
    """scripts/gpu_moe_layer.py as a module (registered first: its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("gpu_moe_layer", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_moe_layer"] = mod
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One two-process dry run of every part (about 20 s of CPU time)."""
    out = tmp_path_factory.mktemp("gpu") / "moe.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(out.read_text())


def test_dry_run_records_every_part(dry_run: tuple[Path, dict[str, Any]]) -> None:
    path, doc = dry_run
    prov = doc["provenance"]
    assert prov["dry_run"] is True and prov["complete"] is True and prov["world"] == 2
    assert prov["backend"] == "gloo" and "--dry-run" in prov["command"]
    for key in ("gpu", "driver", "cuda", "torch", "megatron_core", "date"):
        assert key in prov
    # (b) the GEMM curves of every model config, in calibrate_gpu's format, refused as a dry run
    assert doc["calibration"]["status"] == "measured"
    assert set(doc["models"]) == set(_script().calibrate_gpu.model_shapes())
    for entry in doc["models"].values():
        assert len(entry["tokens"]) == len(entry["seconds"]) > 0
    with pytest.raises(ValueError, match="dry-run"):
        load_calibration(path, "qwen3-30b-a3b")
    # (c) the all-to-all over every payload; (d) the executor's moved-expert and replica path
    a2a = doc["all_to_all"]
    assert a2a["status"] == "measured" and len(a2a["rows"]) == 3
    assert all(r["seconds"] > 0 and r["bytes_per_rank"] > 0 for r in a2a["rows"])
    ex = doc["executor"]
    assert ex["status"] == "measured", ex.get("reason")
    assert ex["static"]["reorder_moved_experts"] == 0 and ex["static"]["replica_buffer_bytes"] == 0
    assert ex["moved_replicated"]["reorder_moved_experts"] == 2 * 2  # 2 layers x one expert of each GPU
    assert ex["moved_replicated"]["replica_buffer_bytes"] > 0


def test_dry_run_layer_rows_have_the_asked_skew(dry_run: tuple[Path, dict[str, Any]]) -> None:
    _, doc = dry_run
    layer = doc["moe_layer"]
    assert layer["status"] == "measured"
    assert not [s for s in layer["skipped"] if s["status"] == "failed"], layer["skipped"]
    # DeepEP never runs on the CPU; it is recorded with its reason, never left out
    deepep = [s for s in layer["skipped"] if s["id"].endswith("flex-deepep")]
    assert len(deepep) == 2 and all("CUDA" in s["reason"] for s in deepep)
    names = ["balanced", "biased_1.2", "biased_1.5", "W1_hot_expert_set", "W2_hot_rank"]
    for model in ("deepseek-proxy", "mixtral-proxy"):
        for impl in ("torch", "megatron"):
            rows = [r for r in layer["rows"] if r["id"].startswith(f"{model}/{impl}/alltoall/")]
            reasons = [s for s in layer["skipped"] if s["id"].startswith(f"{model}/{impl}/")]
            assert [r["workload"]["name"] for r in rows] == names or (impl == "megatron" and reasons)
            for r in rows:
                w, t, k = r["workload"], r["tokens_per_gpu"], r["model"]["top_k"]
                load = np.array(w["load"])
                assert load.shape == (2, r["model"]["num_experts"]) and (load.sum(axis=1) == t * k).all()
                assert r["forward_ms"] > 0 and r["backward_ms"] > 0
                if w["target_skew"] is not None:  # within one slot of the rank's mean
                    assert abs(w["skew"] - w["target_skew"]) <= 2 / (t * k), (r["id"], w["skew"])
                else:
                    assert w["skew"] > 1.3, (r["id"], w["skew"])  # the peer's hot workloads are hot


def test_reader_turns_rows_into_priced_layer_rows(
    dry_run: tuple[Path, dict[str, Any]], tmp_path, capsys
) -> None:
    from experiments.validation.cli import main as validate

    path, doc = dry_run
    rows_file = tmp_path / "rows.json"
    assert gm.main([str(path), "--out", str(rows_file)]) == 2  # a dry run is no measurement
    assert "provenance.dry_run" in capsys.readouterr().err
    args = [str(path), "--out", str(rows_file), "--allow-dry-run", "--cluster", "hopper"]
    assert gm.main(args) == 0
    balanced = json.loads(rows_file.read_text())["rows"]
    assert {r["routing"]["kind"] for r in balanced} == {"balanced"} and balanced
    assert gm.main([*args, "--workloads", "all"]) == 0
    rows = json.loads(rows_file.read_text())["rows"]
    assert len(rows) == len(doc["moe_layer"]["rows"])
    assert all(r["role"] == "check" and "cluster.gpus_per_node=2" in r["overrides"] for r in rows)
    capsys.readouterr()
    assert validate(["--moe-layer", "--data", str(rows_file)]) == 0
    printed = capsys.readouterr().out
    assert (
        "check rows: |model / measured - 1| of forward + backward" in printed
        and f"({len(rows)} rows)" in printed
    )


def test_one_gpu_records_why_the_collective_parts_were_skipped(tmp_path) -> None:
    out = tmp_path / "one.json"
    proc = _run("--dry-run", "--world", "1", "--parts", "all_to_all", "executor", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(out.read_text())
    for part in ("all_to_all", "executor"):
        assert doc[part]["status"] == "skipped" and "one GPU" in doc[part]["reason"]
    for part in ("calibration", "moe_layer"):
        assert doc[part] == {"status": "skipped", "reason": "not in --parts"}
    gm.load_measurements(out, allow_dry_run=True)  # a file with skipped parts is still a valid file


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--skews", "0.9"], "--skews 0.9"),
        (["--skews", "9"], "--skews 9"),  # above what 8 mixtral experts top-2 can route (E / k = 4)
        (["--models", "nope"], "--models ['nope']"),
        (["--out", "/nonexistent/dir/x.json"], "--out"),
        (["--repeats", "0"], "--repeats 0"),
    ],
)
def test_bad_arguments_exit_2_before_any_work(args: list[str], flag: str, capsys) -> None:
    with pytest.raises(SystemExit) as err:
        _script().parse(["--dry-run", *args])
    assert err.value.code == 2
    assert flag in capsys.readouterr().err


def test_routes_hold_exact_counts_and_distinct_experts() -> None:
    mod = _script()
    rng = np.random.default_rng(0)
    counts = np.array([16, 16, 3, 0, 13, 16])  # T = 16 tokens, top-4
    routes = mod.routes_from_counts(counts, 4, rng)
    assert routes.shape == (16, 4)
    assert (np.bincount(routes.ravel(), minlength=6) == counts).all()
    assert all(len(set(r)) == 4 for r in routes.tolist())
    with pytest.raises(ValueError, match="cannot be routed"):
        mod.routes_from_counts(np.array([17, 15, 16, 16]), 4, rng)  # an expert above T: a token twice


# ------------------------------------------------------------------------------------------------- reader
def _valid_doc() -> dict[str, Any]:
    """A minimal measured file as scripts/gpu_moe_layer.py writes it (one GPU, one layer row)."""
    model = {
        "name": "mixtral-proxy", "num_layers": 1, "num_moe_layers": 1, "hidden": 4096, "moe_ffn": 14336,
        "num_experts": 8, "top_k": 2, "num_heads": 8, "num_kv_heads": 8, "head_dim": 512,
        "shared_experts": 0, "shared_ffn": 0, "dense_ffn": 0,
    }  # fmt: skip
    return {
        "provenance": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "driver": "580.1",
            "cuda": "13.0",
            "torch": "2.11.0",
            "megatron_core": None,
            "date": "2026-12-07T00:00:00+00:00",
            "command": "python x.py",
            "dtype": "bfloat16",
            "dry_run": False,
            "world": 1,
            "complete": True,
        },
        "calibration": {"status": "measured", "settings": {"group": 8, "repeats": 10}},
        "models": {"qwen3-30b-a3b": {"tokens": [1, 4, 16], "seconds": [1e-5, 2e-5, 5e-5]}},
        "moe_layer": {
            "status": "measured",
            "rows": [
                {
                    "id": "mixtral-proxy/torch/alltoall/balanced",
                    "implementation": "torch",
                    "dispatcher": "alltoall",
                    "model": model,
                    "tokens_per_gpu": 8,
                    "world": 1,
                    "dtype": "bfloat16",
                    "forward_ms": 4.0,
                    "backward_ms": 8.0,
                    "workload": {"name": "balanced", "kind": "balanced", "skew": 1.0, "load": [[2] * 8]},
                }
            ],
            "skipped": [
                {"id": "mixtral-proxy/megatron/alltoall", "status": "skipped", "reason": "no megatron"}
            ],
        },
        "all_to_all": {"status": "skipped", "reason": "one GPU visible"},
        "executor": {"status": "skipped", "reason": "one GPU visible"},
    }


def test_reader_accepts_a_measured_file_the_calibration_reads(tmp_path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_valid_doc()))
    doc = gm.load_measurements(path)
    (row,) = gm.layer_rows(doc, path)
    assert row["overrides"][0] == "cluster=hopper" and row["role"] == "check"
    assert row["id"] == "gpu/h100-80gb-hbm3x1/mixtral-proxy/torch/alltoall/balanced"
    assert gm.layer_rows(doc, path, role="calibration")[0]["role"] == "calibration"
    curve = load_calibration(path, "qwen3-30b-a3b")
    assert curve is not None and curve[0].tolist() == [1, 4, 16]


def _set(doc: dict[str, Any], dotted: str, value: Any) -> None:
    *head, last = dotted.split(".")
    node: Any = doc
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        ("provenance.gpu", KeyError, "provenance.gpu: missing"),
        ("provenance.world", "1", "provenance.world: expected int"),
        ("provenance.dry_run", True, "provenance.dry_run"),
        ("moe_layer.rows.0.forward_ms", -1.0, "moe_layer.rows[0].forward_ms"),
        ("moe_layer.rows.0.backward_ms", float("nan"), "moe_layer.rows[0].backward_ms"),
        ("moe_layer.rows.0.dispatcher", "hybridep", "moe_layer.rows[0].dispatcher"),
        ("moe_layer.rows.0.world", 2, "moe_layer.rows[0].world"),
        ("moe_layer.rows.0.model.top_k", KeyError, "moe_layer.rows[0].model.top_k"),
        ("moe_layer.rows.0.workload.load", [[2] * 7], "moe_layer.rows[0].workload.load"),
        ("moe_layer.rows.0.workload.load", [[3] * 8], "moe_layer.rows[0].workload.load"),
        ("moe_layer.skipped.0.reason", "", "moe_layer.skipped[0]"),
        ("all_to_all.reason", KeyError, "all_to_all.reason"),
        ("executor.status", "done", "executor.status"),
        ("models", [], "models: expected dict"),
    ],
)
def test_reader_refuses_a_malformed_file_naming_file_and_field(
    dotted: str, value: Any, field: str, tmp_path, capsys
) -> None:
    doc = copy.deepcopy(_valid_doc())
    _set(doc, dotted, value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    assert gm.main([str(path), "--out", str(tmp_path / "rows.json")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and field in err, err
    assert not (tmp_path / "rows.json").exists()


def test_reader_refuses_unreadable_files_and_unknown_gpus(tmp_path, capsys) -> None:
    path = tmp_path / "m.json"
    path.write_text("{not json")
    assert gm.main([str(path), "--out", str(tmp_path / "r.json")]) == 2
    assert "cannot be read as JSON" in capsys.readouterr().err
    doc = _valid_doc()
    doc["provenance"]["gpu"] = "NVIDIA H200"  # hopper.yaml holds the H100's memory: named, never guessed
    path.write_text(json.dumps(doc))
    assert gm.main([str(path), "--out", str(tmp_path / "r.json")]) == 2
    assert "provenance.gpu" in capsys.readouterr().err
    assert gm.main([str(path), "--out", str(tmp_path / "r.json"), "--cluster", "hopper"]) == 0
    assert gm.main([str(path), "--out", str(tmp_path / "r.json"), "--cluster", "nope"]) == 2
