"""The config schema (experiments/config/schema.py): derived from the config groups, it knows every key a
composed config holds; flags take booleans only; hostile values drawn at random are refused by name, never
crash."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.schema import _leaves, config_schema, override_problems
from tests.builders import TINY_CELL, cfg


@pytest.mark.parametrize("group", ["planner", "model", "cluster", "executor", "logger", "trace", "workload"])
def test_the_schema_holds_every_key_of_every_composed_option(group: str) -> None:
    schema = config_schema()
    for option in schema.groups[group]:
        composed = OmegaConf.to_container(cfg(f"{group}={option}"), resolve=False)
        missing = [key for key, _ in _leaves(composed) if key not in schema.kinds]
        assert not missing, f"{group}={option}: {missing}"


def test_the_schema_holds_every_preset_key() -> None:
    schema = config_schema()
    for option in schema.groups["experiment"]:
        composed = OmegaConf.to_container(cfg(f"+experiment={option}"), resolve=False)
        assert [k for k, _ in _leaves(composed) if k not in schema.kinds] == [], option


def test_flags_come_from_the_yaml_and_the_settings_dataclasses() -> None:
    schema = config_schema()
    for key in ("dump_plans", "cluster.ep_overlap", "simulator.check_plans", "control_plane.enabled"):
        assert schema.is_flag(key), key  # yaml
    for key in ("planner.replicate.refill_aware", "planner.reorder.locality", "executor.warmup"):
        assert schema.is_flag(key), key  # GreedyConfig, AnnealConfig (dataclass nodes), the executor yaml
    assert not schema.is_flag("seed") and not schema.is_flag("planner.replica_slots")


def test_overrides_of_unknown_options_and_keys_name_the_closest() -> None:
    problems = override_problems(["planner=megatron,relibrax", "cluster.nodez=2", "seed=1", "~logger"])
    assert len(problems) == 2
    assert "planner=relibrax" in problems[0] and "the closest is relibra" in problems[0]
    assert "cluster.nodez" in problems[1] and "cluster.nodes" in problems[1]


_KEYS = sorted(
    k
    for k, kinds in config_schema().kinds.items()
    if "map" not in kinds and not k.endswith("_target_") and ".candidates." not in k
)
_HOSTILE = st.one_of(
    st.booleans(),
    st.none(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 2**31, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["false", "no", "maybe", "", "1e3", "null", "[a]"]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(_KEYS), value=_HOSTILE, planner=st.sampled_from(["megatron", "relibra", "eplb"]))
@example(key="cluster.hardware.hbm_efficiency", value="false", planner="megatron")  # crashed float()
def test_a_hostile_value_of_any_key_is_refused_by_name_or_accepted_typed(key, value, planner) -> None:
    c = cfg(*TINY_CELL, f"planner={planner}")
    if OmegaConf.select(c, key, default="<absent>") == "<absent>":
        return  # the key belongs to another option of its group
    OmegaConf.update(c, key, value, force_add=True)
    schema = config_schema()
    try:
        check_config(c)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    if schema.is_flag(key):
        assert isinstance(value, bool), f"{key}={value!r} accepted as a flag"
    if key in ("seed", "cluster.nodes", "cluster.gpus_per_node", "model.num_experts"):
        assert isinstance(value, int) and not isinstance(value, bool) and value >= 0, (key, value)
