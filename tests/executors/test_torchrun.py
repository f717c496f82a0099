"""``torchrun`` / ``env://`` mode of the torch executor: a ``plans.npz`` run by 4 processes equals the
single-process unbalanced layer (outputs, input gradients and every parameter gradient), and bad inputs are
refused before any process group starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relibra.executors.launch import DistEnv, main, plans_from_dump, slot_table
from relibra.executors.plan_check import PlanRefused
from relibra.executors.torch_moe import ExpertShape, dense_init, expert_init, reference_forward
from relibra.invariants import PlanInvariantError, sample_loads
from relibra.planners.protocols import home_assign, static_placement

REPO = Path(__file__).resolve().parents[2]
SHAPE = ExpertShape(hidden=8, ffn=4)
RTOL = 1e-5
TINY = [
    "model=olmoe-1b-7b",
    "cluster.nodes=2",
    "cluster.gpus_per_node=2",
    "trace.samples_per_batch=8",
    "trace.max_tokens=64",
    "trace.num_batches=1",
    "logger=none",
]


def _torchrun() -> str:
    local = REPO / ".venv" / "bin" / "torchrun"
    return str(local if local.exists() else Path(sys.executable).parent / "torchrun")


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def run_torchrun(plans: Path, out: Path, nproc: int = 4) -> None:
    cmd = [_torchrun(), "--standalone", f"--nproc-per-node={nproc}", "-m", "relibra.executors.launch"]
    cmd += ["--plans", str(plans), "--out", str(out), "--hidden", str(SHAPE.hidden), "--ffn", str(SHAPE.ffn)]
    proc = subprocess.run(
        [*cmd, "--record"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def close(actual: np.ndarray | torch.Tensor, expected: torch.Tensor | None, what: str) -> None:
    assert expected is not None, f"{what}: the reference has no gradient"
    actual = torch.as_tensor(actual)
    scale = float(expected.abs().max()) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=RTOL, atol=RTOL * max(scale, 1e-12), msg=lambda m: f"{what}: {m}"
    )


def assert_matches_reference(plans_path: Path, out: Path) -> int:
    """Recompute every recorded micro-batch with :func:`reference_forward`; returns micro-batches checked."""
    with np.load(plans_path) as z:
        mb_batch = z["mb_batch"]
        meta = json.loads(str(z["meta"]))
    num_layers, num_experts = int(meta["num_layers"]), int(meta["num_experts"])
    world = int(meta["nodes"]) * int(meta["gpus_per_node"])
    res = dict(np.load(out / "executor.npz"))
    assert res["moe_time_s"].shape == (len(mb_batch), num_layers)
    assert np.isfinite(res["moe_time_s"]).all() and (res["moe_time_s"] > 0).all()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: tiny matmuls; more threads only add contention on a shared CPU
    try:
        return _check_batches(res, mb_batch, num_layers, num_experts, world)
    finally:
        torch.set_num_threads(threads)


def _check_batches(
    res: dict[str, np.ndarray], mb_batch: np.ndarray, num_layers: int, num_experts: int, world: int
) -> int:
    checked = 0
    for b in np.unique(mb_batch):
        dense = [dense_init(layer, SHAPE, num_experts) for layer in range(num_layers)]
        attn = torch.stack([d[0] for d in dense]).requires_grad_()
        router = torch.stack([d[1] for d in dense]).requires_grad_()
        experts = torch.stack(
            [
                torch.stack([expert_init(layer, e, SHAPE) for e in range(num_experts)])
                for layer in range(num_layers)
            ]
        ).requires_grad_()
        for m in np.flatnonzero(mb_batch == b):
            for j in range(world):
                h = torch.as_tensor(res[f"hidden/m{m}/g{j}"]).clone().requires_grad_()
                y = reference_forward(h, res[f"routes/m{m}/g{j}"], attn, router, experts, SHAPE)
                y.square().sum().backward()
                close(res[f"out/m{m}/g{j}"], y.detach(), f"output of micro-batch {m}, rank {j}")
                close(res[f"grad_hidden/m{m}/g{j}"], h.grad, f"input gradient of micro-batch {m}, rank {j}")
            checked += 1
        close(res[f"grad_experts/b{b}"], experts.grad, f"expert weight gradients of batch {b}")
        close(res[f"grad_attn/b{b}"], attn.grad, f"attention stand-in gradient of batch {b}")
        close(res[f"grad_router/b{b}"], router.grad, f"router gradient of batch {b}")
    return checked


# ------------------------------------------------------------------------------------- plan dumps
def _dump_from_entry_point(tmp: Path) -> Path:
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "experiments.run", "planner=relibra_replicate_only", "dump_plans=true"]
    proc = subprocess.run(
        [*cmd, *TINY, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir / "plans.npz"


def _reordering_dump(tmp: Path) -> Path:
    """Two batches of one micro-batch each; batch 1 moves experts and replicates one in its home node."""
    rng = np.random.default_rng(7)
    num_layers, num_experts, k, gpus, gpn = 2, 8, 2, 4, 2
    tokens = rng.integers(1, 6, 16)
    counts = np.zeros((16, num_layers, num_experts), dtype=np.int32)
    for s, t in enumerate(tokens):
        for layer in range(num_layers):
            picks = np.argsort(rng.random((t, num_experts)), axis=-1)[:, :k]
            counts[s, layer] += np.bincount(picks.ravel(), minlength=num_experts).astype(np.int32)
    sample_gpu = (np.arange(16) % gpus).astype(np.int32)
    sample_mb = (np.arange(16) // 8).astype(np.int32)
    load = sample_loads(counts, sample_gpu, sample_mb, 2, gpus).astype(np.int32)
    home0 = static_placement(num_layers, num_experts, gpus)
    home1 = np.stack([rng.permutation(home0[layer]) for layer in range(num_layers)])
    assign = np.concatenate([home_assign(load[m : m + 1], h, gpus) for m, h in ((0, home0), (1, home1))])
    for layer in range(num_layers):  # the busiest expert of batch 1 shares its tokens with its node peer
        e = int(np.argmax(assign[1, layer].sum(axis=-1)))
        h = int(home1[layer, e])
        half = assign[1, layer, e, h] // 2
        assign[1, layer, e, h] -= half
        assign[1, layer, e, h ^ 1] += half
    meta = {
        "planner": "test-reorder-replicate",
        "nodes": gpus // gpn,
        "gpus_per_node": gpn,
        "replica_slots": 1,
        "redundant_slots": 0,
        "num_experts": num_experts,
        "num_layers": num_layers,
        "top_k": k,
        "trace": "synthetic",
    }
    path = tmp / "plans.npz"
    np.savez(
        path,
        home=np.stack([home0, home1]).astype(np.int32),
        sample_gpu=sample_gpu,
        sample_mb=sample_mb,
        mb_batch=np.array([0, 1], dtype=np.int32),
        load=load,
        assign=assign.astype(np.int32),
        meta=np.array(json.dumps(meta)),
    )
    return path


@pytest.fixture(scope="module")
def entry_point_run(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("torchrun-entry")
    plans = _dump_from_entry_point(tmp)
    run_torchrun(plans, tmp / "out")
    return plans, tmp / "out"


# ------------------------------------------------------------------------------------------ tests
def test_entry_point_plans_under_torchrun_equal_the_reference(entry_point_run) -> None:
    plans, out = entry_point_run
    assert assert_matches_reference(plans, out) == 1
    summary = json.loads((out / "executor.json").read_text())
    assert (
        summary["world"] == 4
        and summary["backend"] == "gloo"
        and summary["planner"] == "relibra_replicate_only"
    )
    assert summary["replica_buffer_bytes"] == 2 * 2 * SHAPE.params * 4  # r = 2 slots, weights + gradients
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp file left behind


def test_reordering_and_replicas_under_torchrun_equal_the_reference(tmp_path) -> None:
    plans = _reordering_dump(tmp_path)
    executor_plans, _ = plans_from_dump(plans)
    assert executor_plans[1].replicas is not None and (executor_plans[1].replicas >= 0).sum() == 2
    run_torchrun(plans, tmp_path / "out")
    assert assert_matches_reference(plans, tmp_path / "out") == 2
    summary = json.loads((tmp_path / "out" / "executor.json").read_text())
    moved = int((np.load(plans)["home"][0] != np.load(plans)["home"][1]).sum())
    assert moved > 0 and summary["reorder_moved_experts"] == moved


def test_the_reference_check_can_fail(entry_point_run, tmp_path) -> None:
    plans, out = entry_point_run
    res = dict(np.load(out / "executor.npz"))
    res["out/m0/g1"] = res["out/m0/g1"] * (1 + 1e-3)
    (tmp_path / "bad").mkdir()
    np.savez(tmp_path / "bad" / "executor.npz", **res)
    with pytest.raises(AssertionError, match="output of micro-batch 0, rank 1"):
        assert_matches_reference(plans, tmp_path / "bad")


def test_slot_table_lists_the_non_home_experts_each_gpu_computes() -> None:
    home = np.array([[0, 0, 1, 1]])  # [L=1, E=4], G=2
    assign = np.zeros((1, 1, 4, 2), dtype=np.int32)
    assign[0, 0, :, 0] = [3, 1, 2, 0]  # GPU 0 computes experts 2 (non-home) and 0, 1 (home)
    assign[0, 0, :, 1] = [1, 0, 0, 4]
    table = slot_table(home, assign, width=2)
    assert table.tolist() == [[[[2, -1], [0, -1]]]]


_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def test_missing_torchrun_environment_is_named() -> None:
    with pytest.raises(RuntimeError, match="WORLD_SIZE"):
        DistEnv({"RANK": "0", "LOCAL_RANK": "0"})


def test_world_size_mismatch_is_refused_before_any_group(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    plans = _reordering_dump(tmp_path)
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 but the plans are for"):
        main(["--plans", str(plans), "--out", str(tmp_path / "out")], environ=_ENV)


def test_wrong_plans_are_refused_naming_the_invariant(tmp_path, monkeypatch) -> None:
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    path = _reordering_dump(tmp_path)
    arrays = dict(np.load(path))
    bad = arrays["assign"].copy()
    bad[0, 0, 0, 0] += 1
    np.savez(path, **(arrays | {"assign": bad}))
    env = _ENV | {"WORLD_SIZE": "4"}
    with pytest.raises(PlanInvariantError, match=r"\[token conservation\]"):
        main(["--plans", str(path), "--out", str(tmp_path / "out")], environ=env)
    # A cross-node copy: valid where the dump's meta lifts the in-node rule, refused where it keeps it.
    arrays = dict(np.load(_reordering_dump(tmp_path)))
    meta = json.loads(str(arrays["meta"])) | {"replicas_in_home_node": False, "replica_slots": 2}
    far = arrays["assign"].copy()
    e = int(np.argmax(far[1, 0].sum(axis=-1)))
    h = int(arrays["home"][1, 0, e])
    far[1, 0, e, (h + 2) % 4] += 1
    far[1, 0, e, h] -= 1
    np.savez(path, **(arrays | {"assign": far, "meta": np.array(json.dumps(meta))}))
    check = dict(np.load(path))
    plans, _ = plans_from_dump(check)  # a valid dump ...
    assert len(plans) == 2
    meta["replicas_in_home_node"] = True
    np.savez(path, **(check | {"meta": np.array(json.dumps(meta))}))
    with pytest.raises(PlanInvariantError, match=r"\[replicas in home node\]"):
        main(["--plans", str(path), "--out", str(tmp_path / "out")], environ=env)
    assert not (tmp_path / "out").exists()


def test_executor_refusal_is_a_plan_refused(tmp_path, monkeypatch) -> None:
    """A valid dump the executor cannot run (an EPLB-style unbalanced ``home``) is refused by the executor."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    path = _reordering_dump(tmp_path)
    arrays = dict(np.load(path))
    home = arrays["home"][1].copy()
    home[0, 0] = (
        home[0, 0] + 1
    ) % 4  # unbalanced homes are fine in a dump with redundant slots, not for the executor
    assign = arrays["assign"].copy()
    meta = json.loads(str(arrays["meta"])) | {"redundant_slots": 1, "replica_slots": 0}
    assign[1] = home_assign(arrays["load"][1:2], home, 4)[0]
    np.savez(
        path,
        **(
            arrays
            | {
                "home": np.stack([arrays["home"][0], home]),
                "assign": assign,
                "meta": np.array(json.dumps(meta)),
            }
        ),
    )
    with pytest.raises(PlanRefused, match=r"\[home balance\]") as err:
        main(["--plans", str(path), "--out", str(tmp_path / "out")], environ=_ENV | {"WORLD_SIZE": "4"})
    assert "batch 1" in str(err.value)
