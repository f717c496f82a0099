"""Exact references for one layer's reordering problem: a MILP (OR-Tools, SCIP) and brute force.

Both minimise the same true objective as the annealer
(:func:`relibra.planners.reorder.anneal.placement_objective`): for every micro-batch row ``m`` of a
:class:`~relibra.planners.reorder.anneal.LayerProblem`,
``max_g comp[m, g] + max_g comm[m, g]`` plus the busiest GPU's migration charge, with home-only assignment.

MILP: binary ``y[e, g]`` (expert ``e`` homed on ``g``), ``sum_g y[e, g] = 1``, ``sum_e y[e, g] = E / G``.
The traffic ``T[m, j, g] = sum_e x[m, e, j] * y[e, g]`` is linear in ``y``, so is every per-GPU link-class
load (routing of :func:`~relibra.planners.reorder.links.link_routes`); each GPU's all-to-all time
``2 * (max(nvlink_dispatch, nic_dispatch) + max(nvlink_combine, nic_combine)) + latency`` and the two maxima
over GPUs are epigraph variables. The model is exact for the linearised cost, so a proven optimum is the
annealer's true optimum.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from relibra.cluster import ClusterSpec
from relibra.planners.reorder.anneal import LayerProblem, placement_objective
from relibra.planners.reorder.links import NUM_LINKS, link_routes

__all__ = ["ExactResult", "brute_force_reorder", "milp_reorder"]


@dataclass(frozen=True)
class ExactResult:
    """An exact solver's answer for one layer."""

    home: np.ndarray
    """int32 [E]: best placement found."""
    objective_s: float
    """True objective of ``home`` in seconds (re-evaluated, not the solver's value)."""
    bound_s: float
    """Proven lower bound in seconds (equals ``objective_s`` when optimal)."""
    optimal: bool
    """True when the solver proved optimality."""
    solve_time_s: float


def milp_reorder(
    problem: LayerProblem,
    cluster: ClusterSpec,
    *,
    time_limit_s: float = 60.0,
    hint: np.ndarray | None = None,
    threads: int = 1,
) -> ExactResult:
    """Solve one layer exactly with SCIP. ``hint`` [E]: a placement to start from (e.g. the annealer's)."""
    mb, e_total, g_total = problem.x.shape
    if e_total % g_total != 0:
        raise ValueError(f"E={e_total} experts is not divisible by G={g_total} GPUs")
    if problem.overlap_mbs:
        raise ValueError(
            "milp_reorder models the sum of T_MoE over micro-batches; this problem prices "
            "cluster.ep_overlap=true (the overlapped layer time): use brute_force_reorder or the annealer"
        )
    if problem.deepep:
        raise ValueError(
            "milp_reorder models alltoall's communication (linear in the placement); this problem prices "
            "cluster.dispatcher=deepep, which is not: use brute_force_reorder or the annealer"
        )
    if problem.compute_group != 1:
        raise ValueError(
            f"milp_reorder models the per-GPU compute term; this problem uses compute_group="
            f"{problem.compute_group} (compute_level='node'): build it with compute_level='gpu' or use "
            "brute_force_reorder, which evaluates either objective"
        )
    per_gpu = e_total // g_total
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is None:  # pragma: no cover - SCIP ships with OR-Tools wheels
        raise RuntimeError("OR-Tools was built without SCIP; install the official ortools wheel")
    solver.SetNumThreads(threads)
    solver.SetTimeLimit(int(time_limit_s * 1000))
    y = [[solver.BoolVar(f"y_{e}_{g}") for g in range(g_total)] for e in range(e_total)]
    for e in range(e_total):
        solver.Add(sum(y[e]) == 1)
    for g in range(g_total):
        solver.Add(sum(y[e][g] for e in range(e_total)) == per_gpu)
    # NOTE: experts are interchangeable only when their loads are identical; no symmetry breaking here.
    idx, cnt = link_routes(cluster.nodes, cluster.gpus_per_node)
    # route[j, g, link * G + gpu] = 1 when a token j -> g is counted on that GPU's link class.
    route = np.zeros((g_total, g_total, NUM_LINKS * g_total))
    for j in range(g_total):
        for g in range(g_total):
            route[j, g, idx[j, g, : cnt[j, g]]] = 1.0
    cn, ci, lat = (float(v) for v in problem.coef)
    objective = []
    for m in range(mb):
        c_max = solver.NumVar(0.0, solver.infinity(), f"cmax_{m}")
        k_max = solver.NumVar(0.0, solver.infinity(), f"kmax_{m}")
        objective += [c_max, k_max]
        for g in range(g_total):
            solver.Add(sum(float(problem.w[m, e]) * y[e][g] for e in range(e_total)) <= c_max)
        # coeff[link * G + gpu, e, g]: tokens that homing e on g puts on that GPU's link class.
        coeff = np.einsum("ej,jgk->keg", problem.x[m], route)
        for gpu in range(g_total):
            halves = []
            for base in (0, 4):  # dispatch, combine
                u = solver.NumVar(0.0, solver.infinity(), f"u_{m}_{gpu}_{base}")
                halves.append(u)
                for link, c in ((base, cn), (base + 1, cn), (base + 2, ci), (base + 3, ci)):
                    k = coeff[link * g_total + gpu]
                    nz = np.argwhere(k != 0.0)
                    if nz.size:
                        solver.Add(c * sum(float(k[e, g]) * y[e][g] for e, g in nz) <= u)
            solver.Add(2.0 * (halves[0] + halves[1]) + lat <= k_max)
    if np.any(problem.mig):
        mig_max = solver.NumVar(0.0, solver.infinity(), "migmax")
        objective.append(mig_max)
        for g in range(g_total):
            solver.Add(sum(float(problem.mig[e, g]) * y[e][g] for e in range(e_total)) <= mig_max)
    solver.Minimize(sum(objective))
    if hint is not None:
        hint = np.asarray(hint)
        flat = [y[e][g] for e in range(e_total) for g in range(g_total)]
        vals = [1.0 if hint[e] == g else 0.0 for e in range(e_total) for g in range(g_total)]
        solver.SetHint(flat, vals)
    status = solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise RuntimeError(f"the reordering MILP found no solution within {time_limit_s} s (status {status})")
    values = np.array([[y[e][g].solution_value() for g in range(g_total)] for e in range(e_total)])
    home = values.argmax(axis=1).astype(np.int32)
    obj = placement_objective(problem, home, cluster, (idx, cnt))
    optimal = status == pywraplp.Solver.OPTIMAL
    bound = obj if optimal else float(solver.Objective().BestBound()) * problem.scale
    return ExactResult(
        home=home,
        objective_s=obj,
        bound_s=bound,
        optimal=optimal,
        solve_time_s=solver.wall_time() / 1000.0,
    )


def brute_force_reorder(
    problem: LayerProblem, cluster: ClusterSpec, *, max_placements: int = 200_000
) -> ExactResult:
    """Enumerate every balanced placement (tiny instances only; refuses more than ``max_placements``)."""
    _, e_total, g_total = problem.x.shape
    per_gpu = e_total // g_total
    count = _count_placements(e_total, g_total)
    if count > max_placements:
        raise ValueError(
            f"{count} placements of E={e_total} experts on G={g_total} GPUs exceed max_placements="
            f"{max_placements}; use milp_reorder for this size"
        )
    best_home: np.ndarray | None = None
    best = np.inf
    routes = link_routes(cluster.nodes, cluster.gpus_per_node)
    for home in _placements(np.arange(e_total), g_total, per_gpu):
        obj = placement_objective(problem, home, cluster, routes)
        if obj < best:
            best, best_home = obj, home
    assert best_home is not None
    return ExactResult(home=best_home, objective_s=best, bound_s=best, optimal=True, solve_time_s=0.0)


def _count_placements(e_total: int, g_total: int) -> int:
    per_gpu = e_total // g_total
    out, left = 1, e_total
    for _ in range(g_total):
        out *= math.comb(left, per_gpu)
        left -= per_gpu
    return out


def _placements(experts: np.ndarray, g_total: int, per_gpu: int):  # type: ignore[no-untyped-def]
    """Yield every home [E] with ``per_gpu`` experts on each of ``g_total`` GPUs."""
    e_total = int(experts.max()) + 1 if experts.size else 0

    def rec(remaining: tuple[int, ...], gpu: int, home: np.ndarray):  # type: ignore[no-untyped-def]
        if gpu == g_total:
            yield home.astype(np.int32)
            return
        for chosen in itertools.combinations(remaining, per_gpu):
            home[list(chosen)] = gpu
            rest = tuple(e for e in remaining if e not in chosen)
            yield from rec(rest, gpu + 1, home)

    yield from rec(tuple(int(e) for e in experts), 0, np.zeros(e_total, dtype=np.int64))
