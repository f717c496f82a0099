"""The ``${default:KEY}`` resolver: a run-wide key's default lives in the code, once; the yaml names it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from omegaconf import OmegaConf

from experiments.config.resolvers import CONF_DIR, default_of, load_option
from relibra.cluster import ClusterSpec, HardwareSpec
from relibra.cost.step import TrainingSpec
from relibra.parallel import ParallelDims
from relibra.simulator import SimOptions
from tests.builders import cfg

SCANNED = ("", "cluster", "trace", "workload", "training", "control_plane", "logger")
"""The yaml the rule holds for: config.yaml and the run-wide groups. A model option states its model's
architecture (``shared_experts: 0`` is a fact of the model) and a preset states its experiment's choices."""


def _leaves(tree: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key not in ("defaults", "hydra"):
                yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def _yaml_leaves() -> Iterator[tuple[str, str, Any]]:
    for group in SCANNED:
        paths = [CONF_DIR / "config.yaml"] if not group else sorted((CONF_DIR / group).glob("*.yaml"))
        for path in paths:
            tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            for key, value in _leaves(tree, f"{group}." if group else ""):
                yield path.relative_to(CONF_DIR).as_posix(), key, value


def test_the_resolver_gives_the_library_default() -> None:
    assert default_of("simulator.history_window") == SimOptions.history_window
    assert default_of("simulator.check_plans") is SimOptions.check_plans
    assert default_of("cluster.dispatcher") == ClusterSpec.dispatcher
    assert default_of("cluster.hardware.gemm_model") == HardwareSpec.gemm_model
    assert default_of("parallel.dp") == ParallelDims().dp
    assert default_of("workload.rl_passes") == list(TrainingSpec.rl_passes)  # NOTE: a list, as YAML holds it
    assert default_of("simulator.migration.path") is None


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("simulator.history_windw", "no run-spec field simulator.history_windw"),
        ("seed", "the field has no default value"),
        ("seed.x", "seed is not a node"),
    ],
)
def test_a_bad_key_is_named(key: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        default_of(key)


LISTS = {"workload.rl_passes", "logger.tags"}
"""List-valued defaults the yaml writes out: OmegaConf cannot resolve an interpolation into a list in place
(``OmegaConf.resolve``, which ``--cfg job --resolve`` runs), so these stay literals, held equal here."""


def test_no_yaml_repeats_a_default_of_the_code() -> None:
    """A literal equal to the run-spec field's default is a second copy of it: the yaml says
    ``${default:KEY}`` there instead (so a changed default cannot leave a stale copy behind). A list-valued
    default (:data:`LISTS`) is written out and must equal the code's."""
    copies, lists = [], set()
    for path, key, value in _yaml_leaves():
        if isinstance(value, str) and value.startswith("${"):
            assert key not in LISTS, (path, key)
            continue
        try:
            default = default_of(key)
        except ValueError:
            continue  # NOTE: a key without a default (the yaml is its one place) or an open node's key
        if key in LISTS:
            assert value == default, (path, key, value, default)
            lists.add(key)
        elif value == default and type(value) is type(default):
            copies.append(f"{path}: {key}={value!r}")
    assert not copies, copies
    assert lists == LISTS


def test_the_composed_config_resolves_in_place() -> None:
    """``--cfg job --resolve`` resolves the composition in place (``OmegaConf.resolve``): every
    ``${default:KEY}`` leaf takes a value a leaf can hold."""
    for overrides in ((), ("logger=wandb",), ("+experiment=quick_peer",)):
        composed = cfg(*overrides)
        OmegaConf.resolve(composed)
        assert composed.simulator.history_window == SimOptions.history_window
        assert list(composed.workload.rl_passes) == list(TrainingSpec.rl_passes)


def test_every_default_reference_names_its_own_key_and_resolves_to_the_default() -> None:
    refs = [(p, k, v) for p, k, v in _yaml_leaves() if isinstance(v, str) and v.startswith("${default:")]
    assert len(refs) > 30, refs  # NOTE: config.yaml's simulator, parallel, control plane; every cluster
    for path, key, value in refs:
        assert value == f"${{default:{key}}}", (path, key, value)
        group, _, name = path.removesuffix(".yaml").rpartition("/")
        node: Any = load_option(group, name) if group else cfg()
        for part in key.split(".")[1:] if group else key.split("."):
            node = node[part]
        assert node == default_of(key), (path, key)


def test_a_defaulted_key_is_still_overridden_on_the_command_line() -> None:
    composed = cfg("simulator.history_window=7", "cluster.dispatcher=deepep", "parallel.dp=2")
    assert composed.simulator.history_window == 7
    assert composed.cluster.dispatcher == "deepep"
    assert composed.parallel.dp == 2


def test_an_option_loads_resolved() -> None:
    hw = HardwareSpec(**load_option("cluster", "hopper")["hardware"])
    assert hw.gemm_model == HardwareSpec.gemm_model and hw.name == "H100-SXM"


def test_the_library_reader_of_a_cluster_yaml_takes_the_named_defaults() -> None:
    """``relibra.megatron.planning.load_hardware`` (below the suite: it cannot resolve the suite's
    references) leaves a ``${default:...}`` to HardwareSpec's own default: the same hardware."""
    from relibra.megatron.planning import load_hardware

    for name in ("hopper", "b200", "gb200-nvl72"):
        assert load_hardware(CONF_DIR / "cluster" / f"{name}.yaml") == HardwareSpec(
            **load_option("cluster", name)["hardware"]
        ), name
