"""The run spec (experiments/config/spec.py): one frozen, typed tree built once from a composed config;
OmegaConf refuses a key no field declares and a value of the wrong shape, the spec's stricter types
(integers, finite numbers, YAML booleans) are refused by name, and every quick preset cell's spec carries
the composed config its results-store key is made of."""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import Any

import pytest
from omegaconf import OmegaConf

from experiments.config.errors import ConfigError
from experiments.config.presets import CONF_DIR, cells, compose_cells
from experiments.config.spec import build_spec
from experiments.grid.runner import QUICK_PRESETS
from experiments.store.keys import cell_key
from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.step import TrainingSpec
from relibra.parallel import ParallelDims
from relibra.simulator import SimOptions
from tests.builders import TINY_CELL, cfg


@pytest.mark.parametrize("group", ["planner", "model", "cluster", "executor", "logger", "trace", "workload"])
def test_every_option_of_every_group_builds_a_spec(group: str) -> None:
    for option in sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")):
        spec = build_spec(cfg(f"{group}={option}"))
        assert spec.composed[group] == OmegaConf.to_container(cfg(f"{group}={option}")[group], resolve=True)


def test_the_spec_is_typed_frozen_and_built_from_the_library_dataclasses() -> None:
    spec = build_spec(cfg("planner=relibra", "workload.rl_passes=[recompute,update]"))
    assert isinstance(spec.model, ModelSpec) and isinstance(spec.cluster.hardware, HardwareSpec)
    assert isinstance(spec.parallel, ParallelDims) and isinstance(spec.training, TrainingSpec)
    assert spec.workload.rl_passes == ("recompute", "update")
    assert spec.training.recompute_modules == ("core_attn",)
    assert spec.planner.target == "relibra.planners.compose.relibra" and spec.planner.name == "relibra"
    assert spec.planner.setting("replica_slots") == 2
    assert spec.planner.node()["reorder"]["_target_"].endswith("AnnealConfig")
    with pytest.raises(FrozenInstanceError):
        spec.seed = 1  # type: ignore[misc]


def test_a_key_the_composition_leaves_out_takes_its_one_default() -> None:
    tree: dict[str, Any] = OmegaConf.to_container(cfg(), resolve=True)  # type: ignore[assignment]
    del tree["simulator"]["history_window"], tree["simulator"]["check_plans"], tree["cluster"]["dispatcher"]
    del tree["model"]["vocab"], tree["parallel"]
    spec = build_spec(tree)
    assert spec.simulator.history_window == SimOptions.history_window == 4
    assert spec.simulator.check_plans is SimOptions.check_plans is False
    assert spec.cluster.dispatcher == ClusterSpec.dispatcher == "alltoall"
    assert spec.model.vocab == 151936 and spec.parallel == ParallelDims()


def test_the_composed_config_is_kept_as_plain_data_for_the_store() -> None:
    composed = cfg(*TINY_CELL, "results_dir=/nonexistent/store")
    spec = build_spec(composed)
    assert spec.composed == OmegaConf.to_container(composed, resolve=True)
    assert cell_key(spec.composed) == cell_key(composed)
    assert spec == build_spec(spec.composed)  # the composed tree alone rebuilds the same spec


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+cluster.node=8"], "cluster.node: unknown key"),
        (["+cluster.node=8"], "the closest known key is cluster.nodes"),
        (["+simulator.migration.weight_byte=2"], "closest known key is simulator.migration.weight_bytes"),
        (["+planner.replica_slot=2"], "the closest known key is planner.replica_slots"),
        (["executor=torch", "+executor.hiden=3"], "the closest known key is executor.hidden"),
        (["planner=relibra", "+planner.reorder.seed=3"], "planner.reorder.seed: unknown key"),
        (["+foo=1"], "foo: unknown key"),
        (["workload.rl_passes=false"], "workload.rl_passes"),
        (["cluster.hardware.sms=1.5"], "cluster.hardware.sms=1.5: must be an integer"),
        (["cluster.hardware.bf16_flops=fast"], "cluster.hardware.bf16_flops='fast': must be a finite number"),
        (["cluster.hardware.bf16_flops=inf"], "cluster.hardware.bf16_flops=inf: must be a finite number"),
        (["cluster.ep_overlap=yes"], "cluster.ep_overlap='yes': must be a boolean"),
        (["seed='3'"], "seed='3': must be an integer"),
        (["planner=eplb", "planner.history_window=ten"], "planner.history_window='ten': must be an integer"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_spec(cfg(*TINY_CELL, *overrides))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("preset", QUICK_PRESETS)
def test_every_quick_preset_cell_has_a_spec_and_keeps_its_store_key(preset: str) -> None:
    grid = [[*cell, f"results_dir=/nonexistent/{preset}"] for cell in cells(preset)]
    for cell, composed in zip(grid, compose_cells(preset, grid), strict=True):
        spec = build_spec(composed)
        assert spec.composed == OmegaConf.to_container(composed, resolve=True), cell
        if spec.trace.path is None:  # NOTE: a trace file's key reads the file
            assert cell_key(spec.composed) == cell_key(composed), cell
