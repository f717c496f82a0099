"""The Hydra entry point end to end: compose, run(cfg), the files it writes, and bad configs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra.utils import instantiate

from experiments.config.build import build_cluster, build_model
from experiments.config.errors import ConfigError
from experiments.config.spec import build_spec
from experiments.run import run
from relibra.plan_dump import check_plan_dump
from relibra.simulator import METRIC_COLUMNS
from relibra.trace.format import load_trace, save_trace
from tests.builders import cfg, file_cfg

CONF = str(Path(__file__).resolve().parents[2] / "experiments" / "conf")
REPO = Path(__file__).resolve().parents[2]
REQUIRED = [
    "model",
    "dataset",
    "planner",
    "nodes",
    "gpus_per_node",
    "replica_slots",
    "tokens",
    *METRIC_COLUMNS,
]


def test_megatron_on_trace_file_dumps_valid_plans(trace_file, tmp_path):
    c = file_cfg(trace_file, "planner=megatron", "dump_plans=true", "simulator.check_plans=true")
    results = run(c, run_dir=tmp_path)
    assert len(results) == 1 and set(REQUIRED) <= set(results.columns)
    row = results.iloc[0]
    assert (row["planner"], row["model"], row["nodes"], row["gpus_per_node"]) == (
        "megatron",
        "olmoe-1b-7b",
        2,
        8,
    )
    assert row["dataset"] == "olmoe_test"
    assert row["throughput_tokens_per_s"] == pytest.approx(row["tokens"] / row["step_time_s"])
    on_disk = pd.read_parquet(tmp_path / "results.parquet")
    pd.testing.assert_frame_equal(on_disk, results)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rows"][0]["planner"] == "megatron"
    assert summary["files"] == ["per_layer.parquet", "plans.npz", "results.parquet", "summary.json"]
    assert summary["not_written"] == {}
    assert len(pd.read_parquet(tmp_path / "per_layer.parquet")) > 0
    counts = load_trace(trace_file).to_counts().counts
    meta = check_plan_dump(tmp_path / "plans.npz", counts=counts)
    assert meta["planner"] == "megatron" and meta["nodes"] == 2 and meta["num_experts"] == 64
    with np.load(tmp_path / "plans.npz") as z:
        assert z["home"].shape == (2, 16, 64) and z["assign"].dtype == np.int32
    assert not list(tmp_path.glob(".tmp-*"))


def test_balanced_writes_no_plan_dump(trace_file, tmp_path):
    results = run(file_cfg(trace_file, "planner=balanced", "dump_plans=true"), run_dir=tmp_path)
    assert results.iloc[0]["skew_max"] == 1.0
    assert not (tmp_path / "plans.npz").exists()
    mega = run(file_cfg(trace_file, "planner=megatron"), run_dir=tmp_path / "m")
    assert results.iloc[0]["step_time_s"] < mega.iloc[0]["step_time_s"]


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["cluster.nodes=3"], ["model.num_experts=64", "cluster.nodes * cluster.gpus_per_node"]),
        (["planner.replica_slots=33"], ["planner.replica_slots=33"]),
        (["cluster.nvl_domain=12"], ["cluster.nvl_domain=12", "cluster.gpus_per_node=8"]),
        (
            ["cluster.gpus_per_node=4", "cluster.nodes=4", "cluster.nvl_domain=12"],
            ["cluster.nvl_domain=12", "does not divide", "cluster.nodes * cluster.gpus_per_node"],
        ),
        (["cluster.nvl_domain=0"], ["cluster.nvl_domain=0"]),
        (
            ["cluster.nvl_domain=16", "planner.replica_slots=65"],
            ["planner.replica_slots=65", "NVLink domain"],
        ),
        (["planner=moonep", "planner.replica_slots=2"], ["planner.replica_slots=2", "model.num_experts / G"]),
        (["planner=moonep", "planner.redundant_slots=1"], ["planner.redundant_slots=1"]),
        (
            ["planner=foremoe", "cluster.hardware.host_to_device_bytes_per_s=0"],
            ["cluster.hardware.host_to_device_bytes_per_s=0", "ForeMoE"],
        ),
        (["model=qwen3-30b-a3b"], ["num_experts=64", "model.num_experts=128"]),
        (["planner._target_=baselines.nothing.Planner"], ["planner._target_"]),
        (
            ["workload.tokens_per_microbatch=100"],
            ["workload.samples_per_microbatch", "tokens_per_microbatch"],
        ),
        (["workload.layout=packed"], ["workload.layout=packed", "balanced", "contiguous"]),
        (
            ["planner=relibra", "planner.reorder.locality_tolerance=0"],
            ["planner.reorder.locality_tolerance=0"],
        ),
        (
            ["planner=relibra_reorder_only", "planner.reorder.locality_tolerance=1.5"],
            ["planner.reorder.locality_tolerance=1.5"],
        ),
        (
            ["planner=relibra_portfolio", "planner.candidates.balance.reorder.locality_tolerance=-1"],
            ["planner.candidates.balance.reorder.locality_tolerance=-1"],
        ),
        (["parallel.dp=0"], ["parallel.dp=0"]),
        (["simulator.migration.path=disk"], ["simulator.migration.path=disk"]),
        (["simulator.migration.window_s=-1.0"], ["simulator.migration.window_s=-1.0"]),
        (
            ["planner=relibra_portfolio", "planner.candidates.balance.reorder.horizon=-2"],
            ["planner.candidates.balance.reorder.horizon=-2"],
        ),
        (["planner=relibra", "planner.reorder.start=random"], ["planner.reorder.start='random'"]),
        (["simulator.step=partial"], ["simulator.step='partial'"]),
        (["training.recompute=layers"], ["training.recompute='layers'"]),
        (["training.cuda_graph=full"], ["training.cuda_graph='full'", "full_iteration"]),
        (
            ["training.recompute=selective", "training.recompute_modules=[layernorm,mla_up_proj]"],
            ["training.recompute_modules=['layernorm', 'mla_up_proj']", "has grouped-query attention"],
        ),
        (
            ["model=deepseek-v3", "model.kv_lora_rank=0"],
            ["model.q_lora_rank=1536, model.qk_rope_head_dim=64, model.v_head_dim=128", "kv_lora_rank > 0"],
        ),
        (["model=deepseek-v3", "model.v_head_dim=-1"], ["model.v_head_dim=-1"]),
        (["cluster.comm_sms=-4"], ["cluster.comm_sms=-4: must be an integer >= 0 or null"]),
        (
            ["cluster.dispatcher=deepep", "cluster.ep_overlap=true", "cluster.comm_sms=132"],
            ["cluster.comm_sms=132: must be below cluster.hardware.sms=132"],
        ),
        (
            ["cluster.dispatcher=deepep", "cluster.ep_overlap=true", "cluster.hardware.sms=0"],
            ["needs cluster.hardware.sms, the GPU's SM count"],
        ),
        (["training.recompute_modules=[moe_act]"], ["only with training.recompute=selective"]),
        (["workload.rl_passes=[recompute]"], ["workload.rl_passes=['recompute']", "holds update"]),
        (["workload.rl_passes=[update,update]"], ["workload.rl_passes=['update', 'update']"]),
        (["workload.rl_passes=update"], ["workload.rl_passes='update'"]),
        (["training.optimizer_bytes_per_param=-1"], ["training.optimizer_bytes_per_param=-1"]),
        (["training.overlap_grad_reduce=maybe"], ["training.overlap_grad_reduce='maybe'"]),
        (["+training.bucket_mb=40"], ["training.bucket_mb: unknown key"]),
        (["cluster.precision=fp4"], ["cluster.precision=fp4"]),
        (["cluster.hardware.hbm_efficiency=0"], ["cluster.hardware.hbm_efficiency=0"]),
        (
            ["cluster.precision=fp8", "cluster.hardware.fp8_gemm_efficiency=0"],
            ["cluster.hardware.fp8_gemm_efficiency=0"],
        ),
        (["planner=relibra", "planner.replicate.split=simplex"], ["planner.replicate.split='simplex'"]),
        (
            ["planner=relibra_replicate_only", "planner.replicate.polish_moves=-1"],
            ["planner.replicate.polish_moves=-1"],
        ),
        (
            ["planner=relibra_portfolio", "planner.candidates.balance.replicate.acceptance=greedy"],
            ["planner.candidates.balance.replicate.acceptance='greedy'"],
        ),
        (["planner=relibra_milp", "planner.replicate.solver=GLOP"], ["planner.replicate.solver='GLOP'"]),
        (["planner=relibra", "planner.reorder.beta_stages=0"], ["planner.reorder.beta_stages=0"]),
        (["planner=lplb", "planner.solver=simplex"], ["planner.solver='simplex'"]),
        (["planner=eplb_history", "planner.history_window=0"], ["planner.history_window=0"]),
        (
            ["planner=relibra_keep_placement", "planner.placement=latest"],
            ["planner (relibra_keep_placement)", "placement='latest'"],
        ),
    ],
)
def test_bad_config_stops_before_work(trace_file, tmp_path, overrides, keys):
    (tmp_path / "results.parquet").write_bytes(b"earlier results")
    with pytest.raises(ConfigError) as err:
        run(file_cfg(trace_file, *overrides), run_dir=tmp_path)
    for key in keys:
        assert key in str(err.value)
    assert (tmp_path / "results.parquet").read_bytes() == b"earlier results"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.parquet"]


def test_batch_that_cannot_fill_every_gpu_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"trace\.samples_per_batch=4 cannot fill every GPU"):
        run(cfg("trace.samples_per_batch=4", "cluster.nodes=1", "cluster.gpus_per_node=8"), run_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_unbalanceable_trace_batches_are_reported(trace_file, tmp_path):
    """The trace's batches hold 8 samples for 16 GPUs: the run goes on and says so in its results."""
    results = run(file_cfg(trace_file, "planner=megatron"), run_dir=tmp_path)
    row = results.iloc[0]
    assert row["unbalanceable_batches"] == 2 and row["layout"] == "balanced" and row["routing"] == "trace"
    fits = run(file_cfg(trace_file, "planner=megatron", "cluster.nodes=1"), run_dir=tmp_path / "ep8")
    assert fits.iloc[0]["unbalanceable_batches"] == 0


def test_force_balanced_routes_uniformly(trace_file, tmp_path):
    results = run(file_cfg(trace_file, "planner=force_balanced", "dump_plans=true"), run_dir=tmp_path)
    row = results.iloc[0]
    assert row["planner"] == "force_balanced" and row["routing"] == "uniform"
    assert row["reorder_moved_experts"] == 0.0
    with np.load(tmp_path / "plans.npz") as z:
        meta = json.loads(str(z["meta"]))
        load = z["load"]
    assert meta["routing"] == "uniform"
    # the same tokens as the trace's, routed elsewhere
    assert load.sum() == load_trace(trace_file).to_counts().counts.sum()
    mega = run(file_cfg(trace_file, "planner=megatron"), run_dir=tmp_path / "m")
    assert row["skew_mean"] < mega.iloc[0]["skew_mean"]


def test_missing_trace_file(tmp_path):
    with pytest.raises(ConfigError, match=r"trace\.path=.*no such file"):
        run(cfg(f"trace.path={tmp_path / 'none.npz'}"), run_dir=tmp_path)


def test_unknown_planner_is_refused_by_compose():
    with pytest.raises(Exception, match="planner"):
        cfg("planner=no_such_planner")


@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b", "glm4.5-106b-a12b", "olmoe-1b-7b"])
def test_every_model_composes(model):
    c = cfg(f"model={model}")
    spec = build_model(build_spec(c))
    assert spec.name == model and spec.num_experts % build_cluster(build_spec(c)).num_gpus == 0


@pytest.mark.parametrize("planner", ["megatron", "balanced"])
def test_spine_planners_instantiate(planner):
    obj = instantiate(cfg(f"planner={planner}").planner)
    assert obj.name == planner


def test_synthetic_default(tmp_path):
    pytest.importorskip("relibra.trace.synthetic")
    c = cfg(
        "model=olmoe-1b-7b",
        "trace.num_batches=1",
        "trace.samples_per_batch=16",
        "trace.max_tokens=64",
    )
    results = run(c, run_dir=tmp_path)
    assert results.iloc[0]["dataset"] == "reasoning" and results.iloc[0]["step_time_s"] > 0


def test_wandb_offline_and_failure_keeps_results(trace_file, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))

    def broken(*args, **kwargs):
        raise RuntimeError("no W&B today")

    monkeypatch.setattr(wandb, "init", broken)
    with pytest.warns(RuntimeWarning, match="W&B logging failed"):
        results = run(file_cfg(trace_file, "logger=wandb"), run_dir=tmp_path)
    assert (tmp_path / "results.parquet").exists() and len(results) == 1


@pytest.mark.slow
def test_wandb_offline_run(trace_file, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run(file_cfg(trace_file, "logger=wandb"), run_dir=tmp_path)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_cli_bad_config_exit_code(trace_file, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            f"trace.path={trace_file}",
            "model=olmoe-1b-7b",
            "cluster.nodes=3",
            "workload.layout=packed",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "model.num_experts=64 is not divisible" in proc.stderr
    assert "workload.layout=packed: unknown sample layout" in proc.stderr  # every problem, one message


@pytest.mark.shared_traces
def test_real_olmoe_trace_plans_accepted(shared_traces, tmp_path):
    """The issue's acceptance command on the real OLMoE decode trace saved by another program."""
    from relibra.trace.importers import load_olmoe_decode

    trace = load_olmoe_decode(
        shared_traces / "olmoe-decode", domains=["math", "coding"], samples_per_batch=25
    )
    path = save_trace(trace, tmp_path / "olmoe_decode.npz")
    results = run(
        cfg(
            f"trace.path={path}",
            "model=olmoe-1b-7b",
            "cluster.nodes=2",
            "cluster.gpus_per_node=8",
            "planner=megatron",
            "dump_plans=true",
        ),
        run_dir=tmp_path / "run",
    )
    assert results.iloc[0]["skew_mean"] > 1.0
    check_plan_dump(tmp_path / "run" / "plans.npz", counts=trace.to_counts().counts)


def test_results_dir_reuses_finished_cell(trace_file, tmp_path, monkeypatch):
    import experiments.run as run_module

    c = file_cfg(trace_file, f"+results_dir={tmp_path / 'store'}")
    first = run(c, run_dir=tmp_path / "a")

    def must_not_run(cfg):
        raise AssertionError("a finished cell was computed again")

    monkeypatch.setattr(run_module, "compute", must_not_run)
    again = run(c, run_dir=tmp_path / "b")
    pd.testing.assert_frame_equal(again.reset_index(drop=True), first.reset_index(drop=True))
    assert (tmp_path / "b" / "results.parquet").exists()


def test_reused_cell_of_other_code_is_reported(trace_file, tmp_path, monkeypatch, caplog):
    import experiments.run as run_module
    from relibra.provenance import code_version

    c = file_cfg(trace_file, f"+results_dir={tmp_path / 'store'}")
    first = run(c, run_dir=tmp_path / "a")
    assert first.iloc[0]["code_version"] == code_version()
    caplog.clear()  # NOTE: the first run warns that this trace's batches cannot fill the 16 GPUs
    with caplog.at_level("WARNING", logger="experiments.run"):
        run(c, run_dir=tmp_path / "b")
    assert not caplog.records  # same code, reused cell: silent
    monkeypatch.setattr(run_module, "code_version", lambda: "9.9.9+gnewer")
    with caplog.at_level("WARNING", logger="experiments.run"):
        again = run(c, run_dir=tmp_path / "c")
    assert again.iloc[0]["code_version"] == code_version()  # the stored rows, as they were
    assert any(
        "was computed by code" in r.getMessage() and "9.9.9+gnewer" in r.getMessage() for r in caplog.records
    )


def test_code_version_names_the_commit_or_the_version(monkeypatch):
    import re

    from relibra import __version__, provenance

    got = provenance.code_version()
    assert re.fullmatch(re.escape(__version__) + r"(\+g[0-9a-f]{12}(\.dirty\.[0-9a-f]{12})?)?", got), got
    provenance.code_version.cache_clear()
    monkeypatch.setattr(provenance, "_run_git", lambda *args: (None, "no git"))  # no checkout, or no git
    try:  # NOTE: what is known without git: .git/HEAD's commit and a hash of the sources (test_provenance.py)
        assert re.fullmatch(
            re.escape(__version__) + r"\+(g[0-9a-f]{12}\.)?src\.[0-9a-f]{12}",
            got := provenance.code_version(),
        ), got
    finally:
        provenance.code_version.cache_clear()


def test_code_version_never_writes_the_index(monkeypatch, tmp_path):
    """Reading the version must not rewrite .git/index (``git status`` refreshes stale stat data under
    .git/index.lock unless told not to): a run killed meanwhile would leave the lock in the checkout."""
    import os
    import subprocess
    import time

    from relibra import provenance

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("a\n")
    git("add", "f")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "x")
    time.sleep(1.1)
    os.utime(tmp_path / "f")  # same content, newer stat: a plain `git status` rewrites the index
    index = tmp_path / ".git" / "index"
    before = (index.stat().st_mtime_ns, index.read_bytes())
    monkeypatch.setattr(provenance, "_ROOT", tmp_path)
    provenance.code_version.cache_clear()
    try:
        assert "+g" in provenance.code_version() and ".dirty" not in provenance.code_version()
    finally:
        provenance.code_version.cache_clear()
    assert (index.stat().st_mtime_ns, index.read_bytes()) == before
    assert not (tmp_path / ".git" / "index.lock").exists()


@pytest.mark.parametrize(
    "planner", ["relibra", "eplb", "relibra_portfolio", "ultraep", "llep", "moonep", "foremoe"]
)
def test_control_plane_plans_equal_the_bare_planner(trace_file, tmp_path, planner):
    """The entry point plans through the control plane (staged per layer for ReLibra, one whole-batch task
    for the baselines, one control plane per candidate of a portfolio); its plans, and so every simulated
    metric, equal the planner called directly."""
    rows = {}
    for enabled in ("true", "false"):
        out = run(
            file_cfg(trace_file, f"planner={planner}", f"control_plane.enabled={enabled}", "dump_plans=true"),
            run_dir=tmp_path / enabled,
        )
        rows[enabled] = out.iloc[0]
    via_cp, bare = rows["true"], rows["false"]
    for col in (
        "step_time_s",
        "skew_mean",
        "skew_max",
        "t_comm_s",
        "reorder_moved_experts",
        "t_critical_path_s",
    ):
        assert via_cp[col] == pytest.approx(bare[col], rel=1e-12), col
    with np.load(tmp_path / "true" / "plans.npz") as a, np.load(tmp_path / "false" / "plans.npz") as b:
        for key in ("home", "sample_gpu", "assign", "load"):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_portfolio_candidates_each_get_a_control_plane():
    from experiments.config.build import build_cost, build_planner, planning
    from relibra.control.plane import ControlPlane
    from relibra.planners.portfolio import PortfolioPlanner

    c = cfg("planner=relibra_portfolio", "cluster.nodes=1")
    cluster, model = build_cluster(build_spec(c)), build_model(build_spec(c))
    with planning(
        build_spec(c), build_planner(build_spec(c)), cluster, model, build_cost(build_spec(c), cluster, model)
    ) as wrapped:
        assert isinstance(wrapped, PortfolioPlanner) and wrapped.name == "relibra_portfolio"
        assert all(isinstance(c, ControlPlane) for c in wrapped.candidates)
        assert [c.name for c in wrapped.candidates] == [
            "relibra_balance_incremental",
            "relibra_spread_incremental",
            "relibra_keep_placement",
        ]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["cluster.dispatcher=nccl"], "cluster.dispatcher=nccl"),
        (["cluster.ep_overlap=true", "workload.samples_per_microbatch=8"], "cluster.ep_overlap=true"),
    ],
)
def test_bad_communication_keys_stop_before_work(trace_file, tmp_path, overrides, key):
    (tmp_path / "results.parquet").write_bytes(b"earlier results")
    with pytest.raises(ConfigError) as err:
        run(file_cfg(trace_file, *overrides), run_dir=tmp_path)
    assert key in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.parquet"]


def test_calibration_file_for_another_model_is_refused(trace_file, tmp_path):
    other = tmp_path / "calibration.json"
    other.write_text(json.dumps({"models": {"qwen3-30b-a3b": {"tokens": [1, 64], "seconds": [1e-5, 2e-5]}}}))
    with pytest.raises(ConfigError, match=r"cluster\.calibration=.*no entry for model olmoe-1b-7b"):
        run(file_cfg(trace_file, f"cluster.calibration={other}"), run_dir=tmp_path / "run")


@pytest.mark.parametrize(
    "planner",
    [
        ["planner=relibra_milp"],
        ["planner=relibra", "planner.replicate.split=lp"],
        ["planner=relibra_milp", "planner.majorize.max_iterations=2"],
    ],
)
def test_validate_accepts_deepep_for_the_milp_and_the_lp_split(planner):
    """The replication MILP and the LP split price deepep by majorize-minimize: no refusal any more."""
    from experiments.config.checks import check_config

    c = cfg("cluster.dispatcher=deepep", *planner)
    check_config(c)
    if "planner=relibra_milp" in planner:
        built = instantiate(c.planner, _convert_="all")
        assert built.replicator.majorize.max_iterations == (2 if len(planner) > 1 else 8)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("planner.majorize.rel_tol=-1", "rel_tol"),
        ("planner.majorize.max_iterations=0", "max_iterations"),
    ],
)
def test_bad_majorize_setting_stops_before_work(trace_file, tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"planner\.majorize\.{key}="):
        run(file_cfg(trace_file, "planner=relibra_milp", override), run_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_synthetic_overlap_with_one_microbatch_is_refused_by_validate():
    from experiments.config.checks import check_config

    bad = cfg("cluster.ep_overlap=true", "trace.samples_per_batch=16", "workload.samples_per_microbatch=2")
    with pytest.raises(ConfigError, match=r"cluster\.ep_overlap=true needs at least 2 micro-batches"):
        check_config(bad)


def test_dispatcher_and_overlap_change_the_priced_communication(trace_file, tmp_path):
    base = run(file_cfg(trace_file, "cluster.nodes=2", "cluster.gpus_per_node=2"), run_dir=tmp_path / "a")
    deepep = run(
        file_cfg(trace_file, "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.dispatcher=deepep"),
        run_dir=tmp_path / "b",
    )
    over = run(
        file_cfg(trace_file, "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.ep_overlap=true"),
        run_dir=tmp_path / "c",
    )
    a, d, o = base.iloc[0], deepep.iloc[0], over.iloc[0]
    assert d["t_comm_s"] < a["t_comm_s"]  # top-8 of 64 on 2 nodes: de-duplication saves RDMA
    assert a["t_comm_hidden_s"] == 0.0 and a["t_comm_exposed_s"] == pytest.approx(a["t_comm_s"])
    assert o["t_comm_hidden_s"] > 0.0
    assert o["t_comm_exposed_s"] + o["t_comm_hidden_s"] == pytest.approx(o["t_comm_s"])
    assert o["step_time_s"] == pytest.approx(a["step_time_s"] - o["t_comm_hidden_s"])


def test_bad_whole_step_keys_exit_2_naming_each(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "simulator.step=partial",
            "training.recompute=layers",
            "workload.rl_passes=[reference]",
            "cluster.precision=fp4",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    for key in (
        "simulator.step='partial'",
        "training.recompute='layers'",
        "workload.rl_passes=",
        "cluster.precision",
    ):
        assert key in proc.stderr
    assert not (tmp_path / "results.parquet").exists()
