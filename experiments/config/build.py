"""From a composed Hydra config to the library's objects, with every check done before any work.

Plain functions of a ``DictConfig``: :class:`ConfigError` and the exit-2 refusal (the checks themselves are
:mod:`experiments.config.checks`), :func:`build_cluster`, :func:`build_model`, :func:`build_cost`,
:func:`build_planner` and :func:`load_counts` (the synthetic generator or ``trace.path``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from baselines.force_balanced import ROUTINGS, uniform_routing
from experiments.config.layout_check import build_layout
from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.calibration import load_calibration
from relibra.cost.migration import MigrationPayload, migration_payload
from relibra.cost.model import CostModel
from relibra.cost.step import TrainingSpec
from relibra.parallel import expert_data_parallel
from relibra.planners.protocols import Planner, PlannerPortfolio
from relibra.simulator import SimOptions
from relibra.trace.format import RoutingTrace, load_trace
from relibra.types import SampleCounts, Workload
from relibra.workload import parallel_workload

__all__ = [
    "ConfigError",
    "build_cluster",
    "build_cost",
    "build_migration",
    "build_model",
    "build_planner",
    "build_training",
    "build_workload_for",
    "dataset_name",
    "load_counts",
    "read_trace",
    "refuse",
    "routing",
    "sim_options",
]


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the keys and what would be right."""


EXIT_BAD_CONFIG = 2
"""Exit status of every entry point for a configuration it refuses."""


def refuse(exc: ConfigError, where: str = "") -> NoReturn:
    """Print ``exc`` as one line on stderr (prefixed by the program and ``where``) and exit with status 2."""
    text = " ".join(str(exc).split())
    print(f"relibra-run: {where}{text}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_BAD_CONFIG)


def _plain(node: Any) -> dict[str, Any]:
    return dict(OmegaConf.to_container(node, resolve=True))  # type: ignore[arg-type]


def build_cluster(cfg: DictConfig) -> ClusterSpec:
    """``cfg.cluster`` -> :class:`ClusterSpec` (hardware constants from the cluster yaml)."""
    hw = HardwareSpec(**_plain(cfg.cluster.hardware))
    return ClusterSpec(
        nodes=int(cfg.cluster.nodes),
        gpus_per_node=int(cfg.cluster.gpus_per_node),
        hardware=hw,
        dispatcher=str(cfg.cluster.get("dispatcher", "alltoall")),
        ep_overlap=bool(cfg.cluster.get("ep_overlap", False)),
        nvl_domain=_nvl_domain(cfg),
        precision=str(cfg.cluster.get("precision", "bf16")),
        comm_sms=cfg.cluster.get("comm_sms"),
    )


def build_training(cfg: DictConfig) -> TrainingSpec:
    """``cfg.training`` with ``simulator.step`` and ``workload.rl_passes`` -> :class:`TrainingSpec`."""
    sim = cfg.get("simulator") or {}
    passes = cfg.workload.get("rl_passes", ["update"])
    return TrainingSpec(
        **_plain(cfg.training),
        step=str(sim.get("step", "whole")),
        rl_passes=tuple(passes) if isinstance(passes, Sequence) and not isinstance(passes, str) else passes,
    )


def _nvl_domain(cfg: DictConfig) -> int | None:
    """``cluster.nvl_domain`` (GPUs per NVLink domain; unset or null: ``cluster.gpus_per_node``)."""
    value = cfg.cluster.get("nvl_domain")
    return None if value is None else int(value)


def build_model(cfg: DictConfig) -> ModelSpec:
    """``cfg.model`` -> :class:`ModelSpec`."""
    return ModelSpec(**_plain(cfg.model))


def build_migration(cfg: DictConfig, cluster: ClusterSpec) -> MigrationPayload:
    """``simulator.migration`` with the expert-data-parallel size of ``parallel.*`` and the host link of
    ``cluster.hardware`` (:func:`relibra.cost.migration.migration_payload`)."""
    layout = build_layout(cfg)
    return migration_payload(
        (cfg.get("simulator") or {}).get("migration"),
        expert_data_parallel=expert_data_parallel(layout, cluster.num_gpus),
        host_to_device_bytes_per_s=cluster.hardware.host_to_device_bytes_per_s,
    )


def build_cost(cfg: DictConfig, cluster: ClusterSpec, model: ModelSpec) -> CostModel:
    """The cost model, with the measured GEMM curve of ``cluster.calibration`` if it covers the model and
    the migration payload of :func:`build_migration`."""
    path = cfg.cluster.get("calibration")
    calibration = load_calibration(path, model.name) if path else None
    return CostModel(
        cluster,
        model,
        calibration=calibration,
        training=build_training(cfg),
        migration=build_migration(cfg, cluster),
        layout=build_layout(cfg),
    )


def build_planner(cfg: DictConfig) -> Any:
    """``hydra.utils.instantiate(cfg.planner)``: a Planner or a Bound."""
    return instantiate(cfg.planner, _convert_="all")


@contextmanager
def planning(
    cfg: DictConfig, planner: Any, cluster: ClusterSpec, model: ModelSpec, cost: CostModel
) -> Iterator[Any]:
    """The planner the simulator calls: ``planner`` behind the control plane, so that planning time in the
    results is the control plane's own (staged per layer, worker processes, deadline fallbacks), or the bare
    planner when ``control_plane.enabled=false``. A Bound (Balanced) is no plan and is never wrapped; a
    portfolio keeps its choice and gets one control plane per candidate."""
    cp_cfg = cfg.get("control_plane") or {}
    if not bool(cp_cfg.get("enabled", True)) or not isinstance(planner, Planner):
        yield planner
        return
    from relibra.control.config import ControlPlaneConfig
    from relibra.control.plane import ControlPlane

    deadline = cp_cfg.get("deadline_s")
    locality_deadline = cp_cfg.get("locality_deadline_s")
    config = ControlPlaneConfig(
        workers=int(cp_cfg.get("workers", 0)),
        deadline_s=None if deadline is None else float(deadline),
        locality_deadline_s=None if locality_deadline is None else float(locality_deadline),
        seed=int(cfg.seed),
    )
    if isinstance(planner, PlannerPortfolio):  # each candidate behind its own control plane, then the choice
        with ExitStack() as stack:
            cps = tuple(
                stack.enter_context(ControlPlane.from_planner(c, cluster, model, cost, config))
                for c in planner.candidate_planners()
            )
            yield planner.with_candidates(cps)
        return
    with ControlPlane.from_planner(planner, cluster, model, cost, config) as cp:
        yield cp


def sim_options(cfg: DictConfig, keep_plans: bool) -> SimOptions:
    sim = cfg.get("simulator") or {}
    return SimOptions(
        history_window=int(sim.get("history_window", 4)),
        keep_plans=keep_plans,
        seed=int(cfg.seed),
        check_plans=bool(sim.get("check_plans", False)),
    )


@lru_cache(maxsize=2)
def _read_trace(path: str, mtime_ns: int, size: int) -> RoutingTrace:
    # NOTE: keyed by (path, mtime, size) so check_config() and load_counts() read a trace file once per run,
    # and a file replaced in between is read again.
    return load_trace(path)


def read_trace(path: str) -> RoutingTrace:
    """The validated trace at ``path`` (:func:`relibra.trace.format.load_trace`), read once while it is
    unchanged."""
    stat = Path(path).stat()
    return _read_trace(str(path), stat.st_mtime_ns, stat.st_size)


def routing(cfg: DictConfig) -> str:
    """The routing the planner's run sees: ``trace`` (every planner) or ``uniform`` (force-balanced)."""
    return str(cfg.planner.get("routing", ROUTINGS[0]))


def build_workload_for(cfg: DictConfig, counts: SampleCounts, num_gpus: int) -> tuple[SampleCounts, Workload]:
    """The run's counts (routed uniformly for force-balanced) and their workload under ``workload.*``.

    Returns (counts [S, L, E], workload with load [M, L, G, E]); under ``parallel.tp * parallel.cp = n > 1``
    the counts are the ranks of every sample the EP group holds (:func:`relibra.workload.parallel_workload`:
    ``S * n`` rows, ``S * G`` when the TP x CP group is larger than the EP group). The
    layout depends on the tokens only, so
    every planner of one config gets the same sample layout.
    """
    if routing(cfg) == "uniform":
        counts = uniform_routing(counts, int(cfg.seed))
    # NOTE: under parallel.tp / parallel.cp each sample becomes its TP x CP group's ranks (relibra.workload).
    return parallel_workload(
        counts,
        build_layout(cfg),
        num_gpus,
        samples_per_microbatch=cfg.workload.get("samples_per_microbatch"),
        tokens_per_microbatch=cfg.workload.get("tokens_per_microbatch"),
        layout=str(cfg.workload.layout),
        span=build_model(cfg).attention_span,
    )


def dataset_name(cfg: DictConfig, counts: SampleCounts) -> str:
    """The ``dataset`` result column: ``trace.dataset``, else the trace's meta, else preset or file stem."""
    if cfg.trace.get("dataset"):
        return str(cfg.trace.dataset)
    if cfg.trace.get("path"):
        meta = counts.meta
        return str(meta.get("dataset") or Path(str(cfg.trace.path)).stem)
    return str(cfg.trace.preset)


def load_counts(cfg: DictConfig) -> SampleCounts:
    """Per-sample counts [S, L, E] of the run: ``trace.path`` if set, else the synthetic generator."""
    if cfg.trace.get("path"):
        return read_trace(str(cfg.trace.path)).to_counts()
    from relibra.trace.synthetic import generate_counts  # NOTE: imported late: optional until it exists.

    return generate_counts(
        preset=str(cfg.trace.preset),
        num_experts=int(cfg.model.num_experts),
        num_layers=int(cfg.model.num_moe_layers),
        top_k=int(cfg.model.top_k),
        num_batches=int(cfg.trace.num_batches),
        samples_per_batch=int(cfg.trace.samples_per_batch),
        seed=int(cfg.seed),
        max_tokens=int(cfg.trace.max_tokens),
    )
