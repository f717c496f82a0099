"""Exact references for one layer's reordering problem: a MILP (OR-Tools, SCIP) and brute force.

Both minimise the same true objective as the annealer
(:func:`relibra.planners.reorder.kernels.placement_objective`): for every micro-batch row ``m`` of a
:class:`~relibra.planners.reorder.problem.LayerProblem`,
``max_g comp[m, g] + max_g comm[m, g]`` plus the busiest GPU's migration charge, with home-only assignment
(``compute_group > 1``, ``compute_level='node'``: the compute maximum is over groups of GPUs of their mean
compute, as linear in the placement as the per-GPU one).

MILP: binary ``y[e, g]`` (expert ``e`` homed on ``g``), ``sum_g y[e, g] = 1``, ``sum_e y[e, g] = E / G``.
The traffic ``T[m, j, g] = sum_e x[m, e, j] * y[e, g]`` is linear in ``y``, so is every per-GPU link-class
load (routing of :func:`~relibra.planners.reorder.links.link_routes`); each GPU's all-to-all time
``2 * (max(nvlink_dispatch, nic_dispatch) + max(nvlink_combine, nic_combine)) + latency`` and the two maxima
over GPUs are epigraph variables. The model is exact for the linearised cost, so a proven optimum is the
annealer's true optimum.

``cluster.dispatcher=deepep`` (the problem's ``lq`` / ``tok``): the annealer prices DeepEP with the cost
model's estimate, a token of source ``j`` reaching GPU ``g`` ``T_j * (1 - prod_e (1 - q[e, j]) ** y[e, g])``
times and node ``b`` ``T_j * (1 - prod_e (1 - q[e, j]) ** y_b[e])`` times (``y_b[e]``: ``e`` is homed on
``b``), with every link load a non-negative sum of these hits
(:func:`~relibra.planners.reorder.links.deepep_routes`). The function is concave in the continuous relaxation,
but with binary placement each product is a chain
``P_i = P_(i-1) * (1 - q_i * y_i)`` whose step is the product of a binary and a number in [0, 1]; four
linear inequalities pin such a product exactly (Glover 1975, "Improved linear integer programming
formulations of nonlinear integer problems"; McCormick's envelope, tight at binary points). So the model
stays exact, with one continuous variable per (micro-batch, source, reached GPU or remote node, expert
the source uses), and a proven optimum is again the annealer's true optimum. This was chosen over
majorize-minimize (as :mod:`relibra.planners.replicate.milp` does for continuous splits), which would give a
fixed point of the linearisation with no proof of optimality, while this module's purpose is to be the exact
reference; the price is a larger model, fine for the small instances it is meant for.

``cluster.ep_overlap=true`` (the problem's ``overlap_mbs``): the annealer's true objective is
:func:`relibra.cost.overlap.layer_time` over the micro-batches, with ``C_m`` the row's compute maximum plus
its attention ``attn[m]`` and ``K_m`` its all-to-all maximum (the epigraph variables above), plus migration.
``layer_time`` is a sum of maxima of two affine terms of ``(C, K)`` whose coefficients
:func:`~relibra.cost.overlap.share_term` states (the rule's one statement, read here rather than restated),
all >= 0; so each max is one more epigraph variable, minimising makes every epigraph tight, and the model
stays exact.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from ortools.linear_solver import pywraplp

from relibra import numerics
from relibra.cluster import ClusterSpec
from relibra.cost.overlap import share_term
from relibra.planners.reorder.kernels import placement_objective
from relibra.planners.reorder.links import NUM_LINKS, deepep_routes, link_routes
from relibra.planners.reorder.problem import LayerProblem

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
    idx, cnt = link_routes(cluster.num_domains, cluster.domain_gpus)
    route = _alltoall_route(idx, cnt) if not problem.deepep else None
    droutes = deepep_routes(cluster.num_domains, cluster.domain_gpus) if problem.deepep else None
    cn_d, ci_d, cn_c, ci_c, lat = (float(v) for v in problem.coef)
    objective: list[Any] = []
    rows_ck: list[tuple[Any, Any]] = []
    for m in range(mb):
        c_max = solver.NumVar(0.0, solver.infinity(), f"cmax_{m}")
        k_max = solver.NumVar(0.0, solver.infinity(), f"kmax_{m}")
        rows_ck.append((c_max, k_max))
        group = problem.compute_group
        for n in range(g_total // group):
            gpus = range(n * group, (n + 1) * group)
            load = sum(float(problem.w[m, e]) * y[e][g] for e in range(e_total) for g in gpus)
            solver.Add(load * (1.0 / group) <= c_max)
        if droutes is None:
            assert route is not None
            terms = _alltoall_terms(problem.x[m], route, y)
        else:
            terms = _deepep_terms(solver, problem.lq[m], problem.tok[m], droutes, cluster, y, f"{m}")
        for gpu in range(g_total):
            halves = []
            for base, cn, ci in ((0, cn_d, ci_d), (4, cn_c, ci_c)):  # dispatch, combine
                u = solver.NumVar(0.0, solver.infinity(), f"u_{m}_{gpu}_{base}")
                halves.append(u)
                for link, c in ((base, cn), (base + 1, cn), (base + 2, ci), (base + 3, ci)):
                    on = terms[link * g_total + gpu]
                    if on:
                        solver.Add(c * sum(v * var for var, v in on) <= u)
            solver.Add(2.0 * (halves[0] + halves[1]) + lat <= k_max)
    if problem.overlap_mbs:
        rows = [(c + float(problem.attn[m]), k) for m, (c, k) in enumerate(rows_ck)]
        objective += _overlap_objective(solver, rows, problem.overlap_mbs, problem.contention)
    else:
        objective += [v for ck in rows_ck for v in ck]
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


def _overlap_objective(
    solver: Any, rows: list[tuple[Any, Any]], microbatches: int, contention: float
) -> list[Any]:
    """:func:`relibra.cost.overlap.layer_time` (hard max) of the rows' ``(C, K)`` as linear terms to minimise.

    rows [R]: each row's compute (its maximum plus attention) and all-to-all expressions; ``R`` and
    ``microbatches`` as :func:`~relibra.cost.overlap.layer_time` reads them (``R == 1``: the aggregate row
    standing for ``microbatches`` equal micro-batches); ``contention`` the all-to-all's SM share. Each max
    of two affine terms of
    :func:`~relibra.cost.overlap.share_term` becomes an epigraph variable; every coefficient is >= 0, so
    at the optimum each variable equals its max and the model is exact.
    """
    last = len(rows) - 1
    # (weight, side, own row, neighbour row or None): the first forward alone, each (B[m], F[m + 1]) pair as
    # F[m + 1]'s side 0 beside m, the last backward alone; the aggregate row weighs them as layer_time does.
    passes: list[tuple[float, int, int, int | None]]
    if last == 0 and microbatches > 1:
        passes = [(1.0, 0, 0, None), (1.0, 1, 0, None), (microbatches - 1.0, 0, 0, 0)]
        passes = [(w / microbatches, side, r, nb) for w, side, r, nb in passes]
    else:
        passes = [(1.0, 0, 0, None), *((1.0, 0, m + 1, m) for m in range(last)), (1.0, 1, last, None)]
    out: list[Any] = []
    for i, (weight, side, row, nb) in enumerate(passes):
        for piece in range(2):
            exprs = (
                _share_affine(side, piece, arg, rows[row], None if nb is None else rows[nb], contention)
                for arg in range(2)
            )
            args = [a for a in exprs if a is not None]
            if len(args) == 1:
                out.append(weight * args[0])
                continue
            t = solver.NumVar(-solver.infinity(), solver.infinity(), f"ov_{i}_{piece}")
            for a in args:
                solver.Add(a <= t)
            out.append(weight * t)
    return out


def _share_affine(
    side: int, piece: int, arg: int, own: tuple[Any, Any], nb: tuple[Any, Any] | None, contention: float
) -> Any | None:
    """Argument ``arg`` of :func:`~relibra.cost.overlap.share_term` as an expression of the own row's and the
    neighbour's ``(C, K)`` (None: no neighbour, the pass runs alone); None where the argument does not exist.

    share_term takes the neighbour as numbers, its constant linear in them: probing it at ``(0, 0)``,
    ``(1, 0)`` and ``(0, 1)`` reads the coefficients of the neighbour's ``C`` and ``K``."""
    if nb is None:
        a, b, c = share_term(side, piece, arg, -1.0, 0.0, contention)
        return None if c == -math.inf else a * own[0] + b * own[1] + c
    a, b, c = share_term(side, piece, arg, 0.0, 0.0, contention)
    on_c = share_term(side, piece, arg, 1.0, 0.0, contention)[2] - c
    on_k = share_term(side, piece, arg, 0.0, 1.0, contention)[2] - c
    return a * own[0] + b * own[1] + on_c * nb[0] + on_k * nb[1] + c


def _alltoall_route(idx: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """float64 [G(j), G(g), 8 * G]: 1 where a token ``j -> g`` is counted on that GPU's link class."""
    g_total = idx.shape[0]
    route = np.zeros((g_total, g_total, NUM_LINKS * g_total))
    for j in range(g_total):
        for g in range(g_total):
            route[j, g, idx[j, g, : cnt[j, g]]] = 1.0
    return route


Terms = list[list[tuple[Any, float]]]
"""Per flat link index ``link * G + gpu``: the (variable, tokens per unit) pairs of its load."""


def _alltoall_terms(x_m: np.ndarray, route: np.ndarray, y: list[list[Any]]) -> Terms:
    """alltoall: homing ``e`` on ``g`` puts ``sum_j x[e, j] * route[j, g]`` tokens on each link.

    x_m [E, G(j)]."""
    coeff = np.einsum("ej,jgk->keg", x_m, route)  # [8 * G, E, G]
    return [[(y[e][g], float(k[e, g])) for e, g in np.argwhere(k != 0.0)] for k in coeff]


def _product_chain(solver: Any, picks: list[Any], drop: np.ndarray, name: str) -> list[tuple[Any, float]]:
    """``1 - prod_i (1 - drop[i]) ** picks[i]`` for binary ``picks`` (variables or sums of them), exactly.

    ``P_0 = 1``, ``P_i = P_(i-1) - drop[i] * w_i`` with ``w_i = picks[i] * P_(i-1)``, the product of a
    binary and a number in [0, 1], which four linear inequalities pin exactly (Glover 1975). Returns the
    pairs ``(w_i, drop[i])``: ``1 - P_n = sum_i drop[i] * w_i``.
    """
    out: list[tuple[Any, float]] = []
    for i, (pick, d) in enumerate(zip(picks, drop)):
        prev = 1.0 - sum(float(dd) * w for w, dd in out) if out else 1.0
        w = solver.NumVar(0.0, 1.0, f"w_{name}_{i}")
        solver.Add(w <= pick)
        solver.Add(w <= prev)
        solver.Add(w >= prev - 1.0 + pick)
        out.append((w, float(d)))
    return out


def _deepep_terms(
    solver: Any,
    lq_m: np.ndarray,
    tok_m: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    cluster: ClusterSpec,
    y: list[list[Any]],
    name: str,
) -> Terms:
    """deepep (the annealer's estimate, :func:`~relibra.planners.reorder.kernels.full_state_deepep`): a
    token of
    ``j`` reaches GPU ``g`` ``T_j * (1 - prod_e (1 - q[e, j]) ** y[e, g])`` times and node ``b``
    ``T_j * (1 - prod_e (1 - q[e, j]) ** y_b[e])`` times, each product modelled exactly by
    :func:`_product_chain`; lq_m [E, G(j)] (``log(1 - q)``), tok_m [G(j)]."""
    gidx, gcnt, nidx, ncnt = droutes
    g_total, gpn = cluster.num_gpus, cluster.domain_gpus
    terms: Terms = [[] for _ in range(NUM_LINKS * g_total)]
    on_node = [
        [sum(y[e][g] for g in range(b * gpn, (b + 1) * gpn)) for e in range(lq_m.shape[0])]
        for b in range(cluster.num_domains)
    ]
    for j in range(g_total):
        used = np.flatnonzero(lq_m[:, j] < 0)
        if tok_m[j] <= 0 or used.size == 0:
            continue
        drop = -numerics.expm1(lq_m[used, j])  # q of each used expert
        chains = [
            (gidx[j, g, : gcnt[j, g]], [y[e][g] for e in used], f"{name}_{j}_g{g}")
            for g in range(g_total)
            if gcnt[j, g]
        ] + [
            (nidx[j, b, : ncnt[j, b]], [on_node[b][e] for e in used], f"{name}_{j}_n{b}")
            for b in range(cluster.num_domains)
            if ncnt[j, b]
        ]
        for flat, picks, label in chains:
            pairs = _product_chain(solver, picks, drop, label)
            for r in flat:
                terms[r] += [(w, float(tok_m[j]) * d) for w, d in pairs]
    return terms


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
    routes = link_routes(cluster.num_domains, cluster.domain_gpus)
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
