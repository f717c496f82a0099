"""The parallel keys and the memory check refuse before any work, with one message naming the keys (exit 2),
and every experiment preset's cells are checked against the GPU's memory
(experiments/config/parallel_check.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from experiments.config.build import build_cluster, build_cost, build_model, build_workload_for, load_counts
from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.parallel_check import memory_problems, workload_memory_problems
from experiments.config.presets import CONF_DIR, cells, compose_cells, presets
from experiments.config.spec import build_spec

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trace.num_batches=1", "trace.samples_per_batch=64", "trace.max_tokens=64", "logger=none"]


def _cfg(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="parallel"):
        return compose("config", overrides=[*SMALL, *overrides])


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["parallel.tp=3"], ["parallel.tp=3", "cluster.gpus_per_node=8"]),
        (["parallel.tp=0"], ["parallel.tp=0"]),
        (["parallel.etp=2"], ["parallel.etp=2"]),
        (["parallel.vpp=2"], ["parallel.vpp=2", "parallel.pp"]),
        (["parallel.pp=5"], ["parallel.pp * parallel.vpp = 5 * 1 = 5", "model.num_layers=48"]),
        (
            ["parallel.pp=2", "parallel.chunk_layers=[20,20]"],
            ["parallel.chunk_layers", "model.num_layers=48"],
        ),
        (["parallel.pp=2", "parallel.gpus=64"], ["parallel.gpus=64", "= 32", "do not multiply"]),
        (["+parallel.sp=2"], ["parallel.sp"]),
        (["simulator.memory_check=maybe"], ["simulator.memory_check=maybe"]),
        (
            ["model=qwen3-235b-a22b", "cluster.nodes=8"],
            ["does not fit in memory", "cluster.hardware.hbm_bytes=80.0 GB", "parallel.pp=1"],
        ),
        (["cluster.hardware.hbm_bytes=0"], ["cluster.hardware.hbm_bytes=0"]),
    ],
)
def test_bad_layout_is_refused_naming_its_keys(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(_cfg("model=qwen3-30b-a3b", "cluster.nodes=2", *overrides))
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


def test_a_layout_that_fits_passes_and_warn_or_off_let_a_big_one_run(caplog) -> None:
    check_config(
        _cfg("model=qwen3-30b-a3b", "cluster.nodes=2", "parallel.pp=2", "parallel.vpp=2", "parallel.tp=2")
    )
    big = ["model=qwen3-235b-a22b", "cluster.nodes=8"]
    check_config(_cfg(*big, "simulator.memory_check=off"))
    with caplog.at_level("WARNING"):
        check_config(_cfg(*big, "simulator.memory_check=warn"))
    assert "does not fit in memory" in caplog.text
    # the pipeline shards the parameters: 8 stages of 12 layers hold an eighth of them
    check_config(_cfg(*big, "parallel.pp=8", "parallel.chunk_layers=[12,12,12,12,12,12,11,11]"))


def _cost(cfg):
    cluster, model = build_cluster(build_spec(cfg)), build_model(build_spec(cfg))
    return build_cost(build_spec(cfg), cluster, model)


def test_the_workload_check_counts_the_activations() -> None:
    cfg = _cfg("model=qwen3-30b-a3b", "cluster.nodes=2")
    cost = _cost(cfg)
    assert (
        workload_memory_problems(build_spec(cfg), cost, np.full((4, 16), 4096), np.zeros(4, dtype=np.int32))
        == []
    )
    (problem,) = workload_memory_problems(
        build_spec(cfg), cost, np.full((4, 16), 40_000), np.zeros(4, dtype=np.int32)
    )
    assert "micro-batches of up to 40000 tokens per GPU" in problem and "activations" in problem


def test_the_cli_refuses_a_layout_with_exit_status_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", *SMALL, "parallel.tp=3", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("relibra-run:")]
    assert len(lines) == 1 and "parallel.tp=3" in lines[0]


NOT_FITTING: set[tuple[str, int, str]] = set()
"""(model, EP group, GPU) of preset cells whose estimate exceeds the GPU's memory: none, with the presets'
parallel dimensions (full recompute, and pipeline stages and replicas where the model needs them:
common/paper_scale.yaml, nvl72.yaml; docs/spine.md)."""
MEMORY_KEYS = ("model", "cluster", "workload", "trace", "training", "parallel")


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in presets() if not p.startswith("quick_")])
def test_every_preset_cell_is_checked_against_memory(preset: str) -> None:
    """Each distinct memory shape of the preset's grid (model, EP group, hardware, micro-batches): the check
    before any input and the check on the built workload; the shapes that do not fit are exactly
    :data:`NOT_FITTING`'s (the quick presets share their full preset's shapes)."""
    shapes: dict[tuple[str, ...], list[str]] = {}
    for cell in cells(preset):
        kept = [o for o in cell if o.split("=")[0].split(".")[0] in MEMORY_KEYS]
        shapes.setdefault(tuple(kept), [*kept, "simulator.memory_check=error"])
    if preset.endswith("real_trace"):
        pytest.skip("real_trace reads the shared OLMoE trace (tests/experiments/test_presets.py checks it)")
    if preset.endswith("peer"):
        pytest.skip(
            "peer reads the trace files reproduce writes (tests/experiments/test_peer_traces.py checks it)"
        )
    for cfg in compose_cells(preset, list(shapes.values())):
        cluster, model = build_cluster(build_spec(cfg)), build_model(build_spec(cfg))
        key = (model.name, cluster.num_gpus, cluster.hardware.name)
        cost = build_cost(build_spec(cfg), cluster, model)
        problems = memory_problems(build_spec(cfg), cost)
        if not problems:
            _, work = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), cluster.num_gpus)
            problems = workload_memory_problems(build_spec(cfg), cost, work.tokens, work.mb_batch)
        assert bool(problems) == (key in NOT_FITTING), (key, problems)


@pytest.mark.parametrize("preset", ["overall", "quick_overall", "nvl72", "ep_scaling"])
def test_presets_stop_a_cell_that_does_not_fit(preset: str) -> None:
    """Every preset fits (above), so none needs the warn mode: a cell that does not fit stops before work."""
    cfg = compose_cells(preset, cells(preset)[:1])[0]
    assert cfg.simulator.memory_check == "error"
    assert cfg.training.recompute == "full"
