"""Megatron-LM PR #7488's workloads W0-W7 (relibra.trace.peer) and its trace files (peer_file)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relibra.trace import peer, peer_file
from relibra.trace.format import load_trace
from relibra.trace.peer import LAYER_SEED_STRIDE, WORKLOADS, PeerArgs, fingerprint, routes_for_step

PEER_FINGERPRINTS = {
    "W0_balanced": ("ec19d435b5af99e3", "c275d02e9ee5499f"),
    "W1_hot_expert_set": ("103965e28b276558", "71869f50bad642f1"),
    "W2_hot_rank": ("5a6fc3bfb964ad45", "56b58cf843f112c2"),
    "W3_spread_hot_experts": ("34af6f46bc404ada", "8a1607e1e51e7ecc"),
    "W4_source_ragged": ("f46ec773f0f3104d", "2c931112f6eb5eb8"),
    "W5_zero_expert_rank": ("b0a7357ede5a32dd", "8c27cb40ce16a3ef"),
    "W6_rotating_hotspot": ("c32510a634f80571", "5a89aa32c01eb3ea"),
    "W7_burst": ("fe038740f3d9eb01", "b6fb4a182d3a5b34"),
}
"""The peer's ``workload_fingerprint`` (benchmark.py at f5c50249, run with torch 2.13.0 CPU) of
(E=8, k=2, T=128, 4 steps, seed 1234, EP 2) and (E=128, k=8, T=64, 12 steps, seed 0, EP 8)."""
FINGERPRINT_ARGS = ((8, 2, 128, 4, 1234, 2), (128, 8, 64, 12, 0, 8))

PEER_README_MAX_OVER_MEAN = {
    2: {"W0": 1.000, "W1": 3.312, "W2": 3.219, "W4": 1.281, "W5": 2.156, "W6": 3.312, "W7": 1.219},
    4: {"W0": 1.000, "W1": 1.781, "W2": 1.770, "W4": 1.086, "W5": 2.000, "W6": 1.770, "W7": 1.066},
}
"""The peer's README ("EP=4, 128 tokens per rank, topk 2" and "EP=4, 512 tokens per rank, topk 4", 8 experts,
its default seed 1234, step 0): expert max/mean, every row but W3's (which its code does not give)."""
README_TOKENS = {2: 128, 4: 512}
QWEN = peer.model_shape("qwen3-30b-a3b")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_fingerprints_equal_the_peers(workload: str) -> None:
    got = tuple(fingerprint(workload, *args) for args in FINGERPRINT_ARGS)
    assert got == PEER_FINGERPRINTS[workload]


@pytest.mark.parametrize("top_k", [2, 4])
def test_expert_imbalance_matches_the_peers_readme_but_w3_follows_its_code(top_k: int) -> None:
    for workload in WORKLOADS:
        ids, _ = routes_for_step(workload, 8, top_k, README_TOKENS[top_k], 0, 1234)
        counts = np.bincount(ids.ravel(), minlength=8)
        ratio = counts.max() / counts.mean()
        short = workload[:2]
        if short == "W3":
            # README: 1.281 (k=2), 1.047 (k=4); the code's every-other-expert pool is as hot as W1's
            assert ratio > 1.7
        else:
            assert f"{ratio:.3f}" == f"{PEER_README_MAX_OVER_MEAN[top_k][short]:.3f}"  # as the README prints


@pytest.mark.parametrize("workload", WORKLOADS)
def test_routes_are_distinct_in_range_and_gates_normalised(workload: str) -> None:
    for step in range(8):
        ids, gates = routes_for_step(workload, 64, 8, 96, step, 5)
        assert ids.shape == gates.shape == (96, 8) and ids.dtype == np.int64 and gates.dtype == np.float32
        assert ids.min() >= 0 and ids.max() < 64
        assert all(len(set(row)) == 8 for row in ids.tolist())
        np.testing.assert_allclose(gates.sum(axis=1), 1.0, rtol=1e-6)


def test_pools_shape_each_workload() -> None:
    e, k, t = 64, 4, 400
    w5, _ = routes_for_step("W5_zero_expert_rank", e, k, t, 0, 0)
    assert w5.min() >= e // 2
    w3, _ = routes_for_step("W3_spread_hot_experts", e, k, t, 0, 0)
    assert np.all(w3[np.arange(t) % 4 != 0] % 2 == 0)
    w6 = [routes_for_step("W6_rotating_hotspot", e, k, t, s, 0)[0] for s in (0, 3)]
    assert w6[0][1].max() < 16 and 16 <= w6[1][1].min() < 32  # the hot set moves every 3 steps
    calm, burst = (routes_for_step("W7_burst", e, k, t, s, 0)[0] for s in (2, 3))
    assert burst[::2].max() < 16 and calm[::2].max() >= 16


def test_pool_smaller_than_top_k_is_refused() -> None:
    assert "fewer than top_k=6" in str(peer.pool_problem("W5_zero_expert_rank", 8, 6))
    assert peer.pool_problem("W3_spread_hot_experts", 8, 6) is None  # falls back to every expert, as the peer
    with pytest.raises(ValueError, match="unknown workload"):
        routes_for_step("W9", 8, 2, 4, 0, 0)


def small_model(layers: int = 3) -> peer.ModelShape:
    return peer.ModelShape(name="tiny", num_experts=16, top_k=2, num_moe_layers=layers)


def test_trace_is_steps_by_ranks_of_the_peers_routes() -> None:
    args = PeerArgs("W6_rotating_hotspot", small_model(), ep=4, steps=5, tokens=12, seed=3)
    trace = peer.peer_trace(args)
    assert trace.num_batches == 5 and trace.num_samples == 20 and trace.num_layers == 3
    for step in range(5):
        ids, _ = routes_for_step("W6_rotating_hotspot", 16, 2, 12, step, 3)
        for rank in range(4):
            sample = trace.sample(step * 4 + rank)
            for layer in range(3):
                np.testing.assert_array_equal(sample[:, layer], ids)
    assert trace.meta["peer"]["checksum"] == fingerprint("W6_rotating_hotspot", 16, 2, 12, 5, 3, 4)
    assert trace.meta["dataset"] == "W6_rotating_hotspot"


def test_layer_seeds_draw_each_layer_from_its_own_peer_stream() -> None:
    args = PeerArgs("W1_hot_expert_set", small_model(), ep=2, steps=2, tokens=10, seed=7, layer_seeds=True)
    trace = peer.peer_trace(args)
    for layer in range(3):
        ids, _ = routes_for_step("W1_hot_expert_set", 16, 2, 10, 1, 7 + layer * LAYER_SEED_STRIDE)
        np.testing.assert_array_equal(trace.sample(2)[:, layer], ids)
    assert not np.array_equal(trace.sample(2)[:, 0], trace.sample(2)[:, 1])


def test_cli_writes_a_trace_the_suite_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "w7.npz"
    argv = ["W7_burst", "--model", "qwen3-30b-a3b", "--ep", "8", "--steps", "4", "--tokens", "16"]
    assert peer.main([*argv, "--seed", "0", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert (trace.num_batches, trace.num_samples, trace.num_layers) == (4, 32, QWEN.num_moe_layers)
    assert trace.meta["peer"]["checksum"] in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["W9_none", "--ep", "8"], "WORKLOAD W9_none"),
        (["W0_balanced", "--ep", "3"], "--ep 3"),
        (["W0_balanced", "--ep", "8", "--tokens", "4"], "--tokens 4"),
        (["W0_balanced", "--ep", "8", "--model", "no-such-model"], "--model no-such-model"),
        (["W0_balanced", "--ep", "8", "--out", "/no/such/folder/x.npz"], "--out /no/such/folder/x.npz"),
        (["W0_balanced", "--ep", "8", "--out", "x.txt"], "--out x.txt"),
    ],
)
def test_cli_refuses_bad_input_with_one_message_and_writes_nothing(
    argv: list[str],
    named: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    base = {"--model": "qwen3-30b-a3b", "--steps": "2", "--tokens": "16", "--seed": "0", "--out": "t.npz"}
    for key, value in base.items():
        if key not in argv:
            argv = [*argv, key, value]
    assert peer.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and "\n" not in err
    assert list(tmp_path.iterdir()) == []


# --- the peer's own trace files ---------------------------------------------------------------------------


def write_peer_folder(
    folder: Path,
    workload: str = "W2_hot_rank",
    *,
    steps: int = 1,
    ep: int = 2,
    seed: int = 11,
    step_id: int = 0,
) -> Path:
    """A trace folder as the peer's ``save_trace`` writes one (torch.save per tensor, sha256 in manifest)."""
    ids, gates = routes_for_step(workload, 16, 2, 24, step_id, seed)
    tensors = {
        "token_ids": torch.from_numpy(ids),
        "gates": torch.from_numpy(gates),
        "source_rank": (torch.arange(24) % ep).to(torch.int32),
        "expert_ids": torch.from_numpy(ids.copy()),
    }
    (folder / "tensors").mkdir(parents=True)
    entries = {}
    for name, value in tensors.items():
        path = folder / "tensors" / f"{name}.pt"
        torch.save(value, path)
        entries[name] = {
            "file": f"tensors/{name}.pt",
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "shape": list(value.shape),
            "dtype": str(value.dtype).removeprefix("torch."),
        }
    manifest = {
        "schema_version": 1,
        "producer_commit": "test",
        "seed": seed,
        "logical_layer_id": 0,
        "step_id": step_id,
        "microbatch_id": 0,
        "logical_num_tokens": 24,
        "num_experts": 16,
        "topk": 2,
        "hidden_size": 64,
        "world_size": ep,
        "original_partition": "rank-major, contiguous per source rank",
        "workload_id": workload,
        "workload_checksum": fingerprint(workload, 16, 2, 24, steps, seed, ep),
        "tensors": entries,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def edit_manifest(folder: Path, **changes: object) -> None:
    path = folder / "manifest.json"
    man = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            man.pop(key)
        else:
            man[key] = value
    path.write_text(json.dumps(man))


def test_a_peer_folder_reads_verified_into_a_trace(tmp_path: Path) -> None:
    got = peer_file.read_peer_trace(write_peer_folder(tmp_path / "t", steps=3), steps=3)
    trace = peer_file.to_routing_trace(got, small_model(layers=2))
    assert trace.num_batches == 1 and trace.num_samples == 2 and trace.num_layers == 2
    ids, _ = routes_for_step("W2_hot_rank", 16, 2, 24, 0, 11)
    np.testing.assert_array_equal(trace.sample(1)[:, 1], ids[1::2])  # rank 1's rows, in file order


def test_another_step_is_verified_against_its_own_routes(tmp_path: Path) -> None:
    got = peer_file.read_peer_trace(
        write_peer_folder(tmp_path / "t", "W7_burst", steps=4, step_id=3), steps=4
    )
    assert got.manifest["step_id"] == 3


def tamper_gates(folder: Path) -> None:
    path = folder / "tensors" / "gates.pt"
    torch.save(torch.load(path, weights_only=True) * 0.5, path)


def reroute(folder: Path) -> None:
    """Swap two tokens' routes and re-sign both id tensors: intact files, routes that are not the peer's."""
    man = json.loads((folder / "manifest.json").read_text())
    for name in ("token_ids", "expert_ids"):
        path = folder / "tensors" / f"{name}.pt"
        ids = torch.load(path, weights_only=True)
        torch.save(ids[[1, 0, *range(2, ids.shape[0])]].clone(), path)
        man["tensors"][name]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(man))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "manifest.json").unlink(), "manifest.json: missing"),
        (lambda d: (d / "manifest.json").write_text("{not json"), "not readable JSON"),
        (lambda d: edit_manifest(d, schema_version=2), "unsupported schema_version 2"),
        (lambda d: edit_manifest(d, seed=None), "missing required field(s) ['seed']"),
        (lambda d: (d / "tensors" / "gates.pt").unlink(), "tensor file 'gates' missing"),
        (tamper_gates, "checksum mismatch"),
        (lambda d: (d / "tensors" / "gates.pt").write_bytes(b"garbage"), "checksum mismatch"),
        (lambda d: edit_manifest(d, num_experts=4), "outside [0, num_experts=4)"),
        (lambda d: edit_manifest(d, world_size=1), "source_rank: ranks 0..1 outside"),
        (lambda d: edit_manifest(d, workload_id="W9_custom"), "cannot be verified"),
        (reroute, "not the routes of W2_hot_rank seed 11 step 0"),
        (
            lambda d: edit_manifest(d, workload_checksum="deadbeef"),
            "'workload_checksum' 'deadbeef': checksum failed",
        ),
    ],
)
def test_a_malformed_or_unverifiable_folder_is_refused(tmp_path: Path, damage, message: str) -> None:
    folder = write_peer_folder(tmp_path / "t")
    damage(folder)
    with pytest.raises(peer_file.PeerTraceError) as err:
        peer_file.read_peer_trace(folder)
    assert message in str(err.value)


def test_the_checksum_covers_the_runs_steps_and_ep(tmp_path: Path) -> None:
    folder = write_peer_folder(tmp_path / "t", steps=2, ep=2)
    with pytest.raises(peer_file.PeerTraceError, match="over 1 step"):
        peer_file.read_peer_trace(folder)
    with pytest.raises(peer_file.PeerTraceError, match="at EP 4"):
        peer_file.read_peer_trace(folder, steps=2, ep=4)
    assert peer_file.read_peer_trace(folder, steps=2).manifest["world_size"] == 2


def test_reader_cli_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = write_peer_folder(tmp_path / "t")
    out = tmp_path / "t.npz"
    # the folder's 16 experts are no model of the suite's
    assert peer_file.main([str(folder), "--model", "qwen3-30b-a3b", "--out", str(out)]) == 2
    assert "num_experts=16" in capsys.readouterr().err and not out.exists()
    tamper_gates(folder)
    assert peer_file.main([str(folder), "--model", "qwen3-30b-a3b", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "checksum mismatch" in err and "\n" not in err and not out.exists()


def test_reader_cli_writes_a_suite_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = write_peer_folder(tmp_path / "t")
    monkeypatch.setattr(peer_file, "model_shape", lambda name: small_model(layers=2))
    out = tmp_path / "t.npz"
    assert peer_file.main([str(folder), "--model", "tiny", "--out", str(out)]) == 0
    trace = load_trace(out)
    assert trace.meta["peer"]["checksum"] == fingerprint("W2_hot_rank", 16, 2, 24, 1, 11, 2)
