"""The control plane's delivery: one batch's planning state frozen into the plan the trainer gets.

Layers whose placement is not in keep the previous placement, layers whose replication is not in compute
every expert at home (:class:`~relibra.control.report.Fallback`); the report and the ``cp_*`` timings go
with the plan (module doc of :mod:`relibra.control.plane`). A pure function of the job's state, called
under the coordinator's lock once the job is assembled.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from relibra.cluster import ClusterSpec
from relibra.control.jobs import Job
from relibra.control.report import Fallback, PlanReport
from relibra.planners.protocols import home_assign
from relibra.relabel import relabel_plan
from relibra.types import BatchPlan

__all__ = ["freeze_plan"]


def freeze_plan(
    job: Job, cluster: ClusterSpec, waited: float, now: float, group: int = 1
) -> tuple[BatchPlan, PlanReport]:
    """The plan of assembled ``job`` with its fallbacks, and its report; ``waited``: seconds the trainer's
    call waited, ``now``: ``time.perf_counter()`` at delivery; ``group``: GPUs of a TP x CP group (the
    relabelling keeps them, :mod:`relibra.relabel`)."""
    g = cluster.num_gpus
    asm = job.asm
    assert asm is not None and job.done is not None and job.reordered is not None and job.home is not None
    assert job.assign is not None and job.replicas is not None and job.layer_ready is not None
    assert job.failed_reorder is not None and job.failed_replicate is not None
    assert job.load is not None and job.sample_gpu is not None
    fallback = np.zeros(job.done.shape[0], dtype=np.int8)
    fallback[~job.reordered | job.failed_reorder] |= Fallback.PREVIOUS_PLACEMENT
    fallback[~job.done | job.failed_replicate] |= Fallback.NO_REPLICATION
    home = np.where(job.reordered[:, None] & ~job.failed_reorder[:, None], job.home, job.prev_home)
    home = home.astype(np.int32)
    online, host_path = None, False
    if job.whole is not None and not job.failed_reorder.any():
        plan = job.whole
        home = np.asarray(plan.home, dtype=np.int32)
        assign, replicas, load = plan.assign, plan.replicas, plan.load
        sample_gpu, redundant, stats = plan.sample_gpu, plan.redundant, dict(plan.stats)
        online, host_path = plan.online, plan.host_path
    else:
        assign, replicas, load = job.assign.copy(), job.replicas.copy(), job.load
        sample_gpu, redundant = job.sample_gpu, None
        late = fallback.astype(bool)
        if late.any():
            assign[:, late] = home_assign(
                load[:, late], np.broadcast_to(home[late], (load.shape[0], *home[late].shape)), g
            )
            replicas[:, late] = -1
        stats = dict(job.reorder_stats)
        stats.update(job.locality_stats)
        for key in sorted({k for s in job.replicate_stats for k in s}):
            stats[key] = float(np.mean([s[key] for s in job.replicate_stats if key in s]))
        stats["replicas_mean"] = float((replicas >= 0).sum(axis=-1).mean()) if replicas.size else 0.0
    ready = job.layer_ready
    first = float(np.nanmin(ready)) if np.isfinite(ready).any() else math.nan
    t_all = job.t_all - job.t_arrival if job.finished else math.nan
    report = PlanReport(
        batch=job.batch,
        fallback=fallback,
        layer_ready_s=ready.copy(),
        time_to_first_plan_s=first,
        time_to_all_plans_s=t_all,
        assemble_s=asm.seconds,
        plan_cpu_s=job.cpu_s,
        wait_s=waited,
        retries=job.retries,
        worker_crashes=job.crashes,
        errors=tuple(job.errors),
        locality=job.locality,
        locality_s=job.locality_s,
    )
    # NOTE: only measured timings go into the stats (a stage that did not run has no time, not NaN).
    cp_stats = {
        "cp_time_to_first_plan_s": first,
        "cp_time_to_all_plans_s": t_all,
        "cp_plan_cpu_s": job.cpu_s,
        "cp_assemble_s": asm.seconds,
        "cp_wait_s": waited,
        "cp_previous_placement_layers": float(report.previous_placement_layers),
        "cp_no_replication_layers": float(report.no_replication_layers),
        "cp_locality_fallback": float(report.locality_fallback),
        "cp_locality_s": job.locality_s,
        "cp_retries": float(job.retries),
        "cp_worker_crashes": float(job.crashes),
    }
    stats.update({k: v for k, v in cp_stats.items() if math.isfinite(v)})
    plan = BatchPlan(
        home=home,
        assign=np.asarray(assign, dtype=np.int32),
        load=np.asarray(load, dtype=np.int32),
        sample_gpu=np.asarray(sample_gpu, dtype=np.int32),
        replicas=None if replicas is None else np.asarray(replicas, dtype=np.int32),
        redundant=redundant,
        plan_time_s=t_all if job.finished else now - job.t_arrival,
        stats=stats,
        online=online,
        host_path=host_path,
    )
    if (job.whole is None or job.failed_reorder.any()) and not fallback.any():
        # NOTE: as the serial planner does (ComposedPlanner.plan), keep experts where they were among
        # the equivalent relabellings of the delivered plan; a whole-batch plan relabelled itself, and
        # a plan with fallbacks is left as it is (a late layer keeps its previous placement exactly).
        plan = relabel_plan(plan, job.prev_home, cluster.num_domains, cluster.domain_gpus, group)
    moved = plan.home != job.prev_home
    counts = {
        "reorder_moved_experts": float(np.count_nonzero(moved)),
        "reorder_kept_layers": float(np.count_nonzero(~moved.any(axis=1))),
    }
    return replace(plan, stats={**plan.stats, **counts}), report
