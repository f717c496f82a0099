"""What several benchmark scripts share: specs of ``experiments/conf`` and a timed simulation of a config."""

from __future__ import annotations

import time

from omegaconf import DictConfig

from experiments.config.build import (
    build_cluster,
    build_cost,
    build_model,
    build_planner,
    build_workload_for,
    load_counts,
    sim_options,
)
from experiments.config.resolvers import CONF_DIR, load_option
from experiments.config.spec import build_spec
from relibra.cluster import HardwareSpec, ModelSpec
from relibra.simulator import SimResult, simulate
from relibra.types import SampleCounts

CONF = CONF_DIR
"""The Hydra config groups the benchmarks compose from."""


def hardware() -> HardwareSpec:
    """The Hopper GPU of ``conf/cluster/hopper.yaml``."""
    return HardwareSpec(**load_option("cluster", "hopper")["hardware"])


def model(name: str) -> ModelSpec:
    """The model of ``conf/model/<name>.yaml``."""
    return ModelSpec(**load_option("model", name))


def timed_simulation(cfg: DictConfig, counts: SampleCounts | None = None) -> tuple[SimResult, float]:
    """Simulate ``cfg``'s planner on ``counts`` (default: ``cfg``'s trace) -> (result, simulate's wall s)."""
    spec = build_spec(cfg)
    cluster, model = build_cluster(spec), build_model(spec)
    cost = build_cost(spec, cluster, model)
    given = load_counts(spec) if counts is None else counts
    counts, workload = build_workload_for(spec, given, cluster.num_gpus)
    start = time.perf_counter()
    res = simulate(build_planner(spec), counts, workload, cluster, model, cost, sim_options(spec, False))
    return res, time.perf_counter() - start
