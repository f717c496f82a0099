"""From a run's spec to the library's objects, with every check done before any work.

Plain functions of the checked run spec (:class:`experiments.config.spec.RunSpec`, typed: no key is read
with a fallback here): :class:`ConfigError` and the exit-2 refusal (the checks themselves are
:mod:`experiments.config.checks`), :func:`build_cluster`, :func:`build_model`, :func:`build_cost`,
:func:`build_planner` and :func:`load_counts` (the synthetic generator or ``trace.path``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate

from baselines.force_balanced import ROUTINGS, uniform_routing
from relibra.cluster import ClusterSpec, ModelSpec
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

if TYPE_CHECKING:
    from experiments.config.spec import RunSpec

__all__ = [
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
    "routing",
    "sim_options",
]


def build_cluster(spec: RunSpec) -> ClusterSpec:
    """``cluster.*`` -> :class:`ClusterSpec` (hardware constants from the cluster yaml)."""
    c = spec.cluster
    return ClusterSpec(
        nodes=c.nodes,
        gpus_per_node=c.gpus_per_node,
        hardware=c.hardware,
        dispatcher=c.dispatcher,
        ep_overlap=c.ep_overlap,
        nvl_domain=c.nvl_domain,
        precision=c.precision,
        comm_sms=c.comm_sms,
    )


def build_training(spec: RunSpec) -> TrainingSpec:
    """``training.*`` with ``simulator.step`` and ``workload.rl_passes`` -> :class:`TrainingSpec`."""
    return replace(spec.training, step=spec.simulator.step, rl_passes=spec.workload.rl_passes)


def build_model(spec: RunSpec) -> ModelSpec:
    """``model.*`` -> :class:`ModelSpec`."""
    return spec.model


def build_migration(spec: RunSpec, cluster: ClusterSpec) -> MigrationPayload:
    """``simulator.migration`` with the expert-data-parallel size of ``parallel.*`` and the host link of
    ``cluster.hardware`` (:func:`relibra.cost.migration.migration_payload`)."""
    return migration_payload(
        asdict(spec.simulator.migration),
        expert_data_parallel=expert_data_parallel(spec.parallel, cluster.num_gpus),
        host_to_device_bytes_per_s=cluster.hardware.host_to_device_bytes_per_s,
    )


def build_cost(spec: RunSpec, cluster: ClusterSpec, model: ModelSpec) -> CostModel:
    """The cost model, with the measured GEMM curve of ``cluster.calibration`` if it covers the model and
    the migration payload of :func:`build_migration`."""
    path = spec.cluster.calibration
    calibration = load_calibration(path, model.name) if path else None
    return CostModel(
        cluster,
        model,
        calibration=calibration,
        training=build_training(spec),
        migration=build_migration(spec, cluster),
        parallel=spec.parallel,
    )


def build_planner(spec: RunSpec) -> Any:
    """``hydra.utils.instantiate`` of the ``planner`` node: a Planner or a Bound."""
    return instantiate(spec.planner.node(), _convert_="all")


@contextmanager
def planning(
    spec: RunSpec, planner: Any, cluster: ClusterSpec, model: ModelSpec, cost: CostModel
) -> Iterator[Any]:
    """The planner the simulator calls: ``planner`` behind the control plane, so that planning time in the
    results is the control plane's own (staged per layer, worker processes, deadline fallbacks), or the bare
    planner when ``control_plane.enabled=false``. A Bound (Balanced) is no plan and is never wrapped; a
    portfolio keeps its choice and gets one control plane per candidate."""
    cp_spec = spec.control_plane
    if not cp_spec.enabled or not isinstance(planner, Planner):
        yield planner
        return
    from relibra.control.config import ControlPlaneConfig
    from relibra.control.plane import ControlPlane

    config = ControlPlaneConfig(
        workers=cp_spec.workers,
        deadline_s=cp_spec.deadline_s,
        locality_deadline_s=cp_spec.locality_deadline_s,
        seed=spec.seed,
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


def sim_options(spec: RunSpec, keep_plans: bool) -> SimOptions:
    """``simulator.*`` and ``seed`` -> :class:`SimOptions` (``keep_plans``: the run keeps its plans)."""
    return SimOptions(
        history_window=spec.simulator.history_window,
        keep_plans=keep_plans,
        seed=spec.seed,
        check_plans=spec.simulator.check_plans,
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


def routing(spec: RunSpec) -> str:
    """The routing the planner's run sees: ``trace`` (every planner) or ``uniform`` (force-balanced)."""
    return str(spec.planner.setting("routing", ROUTINGS[0]))


def build_workload_for(spec: RunSpec, counts: SampleCounts, num_gpus: int) -> tuple[SampleCounts, Workload]:
    """The run's counts (routed uniformly for force-balanced) and their workload under ``workload.*``.

    Returns (counts [S, L, E], workload with load [M, L, G, E]); under ``parallel.tp * parallel.cp = n > 1``
    the counts are the ranks of every sample the EP group holds (:func:`relibra.workload.parallel_workload`:
    ``S * n`` rows, ``S * G`` when the TP x CP group is larger than the EP group). The
    layout depends on the tokens only, so
    every planner of one config gets the same sample layout.
    """
    if routing(spec) == "uniform":
        counts = uniform_routing(counts, spec.seed)
    # NOTE: under parallel.tp / parallel.cp each sample becomes its TP x CP group's ranks (relibra.workload).
    return parallel_workload(
        counts,
        spec.parallel,
        num_gpus,
        samples_per_microbatch=spec.workload.samples_per_microbatch,
        tokens_per_microbatch=spec.workload.tokens_per_microbatch,
        layout=spec.workload.layout,
        span=spec.model.attention_span,
    )


def dataset_name(spec: RunSpec, counts: SampleCounts) -> str:
    """The ``dataset`` result column: ``trace.dataset``, else the trace's meta, else preset or file stem."""
    trace = spec.trace
    if trace.dataset:
        return trace.dataset
    if trace.path:
        return str(counts.meta.get("dataset") or Path(trace.path).stem)
    return trace.preset


def load_counts(spec: RunSpec) -> SampleCounts:
    """Per-sample counts [S, L, E] of the run: ``trace.path`` if set, else the synthetic generator."""
    if spec.trace.path:
        return read_trace(spec.trace.path).to_counts()
    from relibra.trace.synthetic import generate_counts  # NOTE: imported late: optional until it exists.

    return generate_counts(
        preset=spec.trace.preset,
        num_experts=spec.model.num_experts,
        num_layers=spec.model.num_moe_layers,
        top_k=spec.model.top_k,
        num_batches=spec.trace.num_batches,
        samples_per_batch=spec.trace.samples_per_batch,
        seed=spec.seed,
        max_tokens=spec.trace.max_tokens,
    )
