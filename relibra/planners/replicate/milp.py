"""Exact intra-node replication (the paper's eq. 7) as a MILP, and the same model as an LP token split.

One problem is one (micro-batch, layer): loads ``x[j, e]``, placement ``home[e]``, ``r`` replica slots per
GPU, ``A[e] = sum_j x[j, e]``. Work is in token equivalents (compute seconds / ``compute_s_per_token``).

Variables, for every expert ``e`` and GPU ``g`` of ``e``'s home node:

* ``a[e, g] >= 0``: tokens of ``e`` computed on ``g``; ``sum_g a[e, g] = A[e]``;
* ``z[e, g]`` binary for ``g != home[e]`` (``z = 1`` at home): ``a[e, g] <= A[e] * z[e, g]``;
  ``sum_e z[e, g] <= r`` over the non-home experts of ``g``'s node;
* ``t_comp >= sum_e a[e, g] + h * (home experts of g + sum_e z[e, g])`` for every ``g``
  (``h = compute_s_per_expert / compute_s_per_token``, the grouped GEMM's small-count loss);
* communication: under the proportional split rule the dispatch traffic ``j -> g`` is
  ``sum_e x[j, e] * a[e, g] / A[e]``, linear in ``a`` because ``A`` is fixed; every link load of
  :meth:`relibra.cost.model.CostModel.link_bytes` is linear in the traffic, so ``p_dispatch[g]`` and
  ``p_combine[g]`` bound the four link classes of ``g`` in each exchange and
  ``t_comm >= 2 * (p_dispatch[g] + p_combine[g])`` (forward and backward);
* objective: ``t_comp + t_comm`` (plus the constant all-to-all latency); under ``cluster.ep_overlap``
  (``overlap`` given) the problem's micro-batch's share of the overlapped layer time with its neighbours
  fixed (:func:`relibra.cost.overlap.microbatch_share` of ``C = t_comp + attention`` and
  ``K = t_comm + latency``): a sum of maxima of affine terms in ``C`` and ``K``
  (:func:`relibra.cost.overlap.share_pieces`, the same coefficients the simulator's rule evaluates), one
  epigraph variable ``s_p >= term`` per max. Every coefficient is non-negative, so minimising the share
  over the epigraph variables ``t_comp`` and ``t_comm`` is exact.

This is exact for the cost model's ``alltoall`` communication and for its compute in the compute-bound
regime (the roofline's ``eff(n) = n / (n + h)`` makes an expert cost ``per_token * (n + h)``). The link
coefficients are taken from :meth:`~relibra.cost.model.CostModel.link_bytes` itself, so both can never drift
apart.

``cluster.dispatcher=deepep``: majorize-minimize (successive linearisation). The cost model prices DeepEP
with :func:`relibra.cost.fabric.deepep_link_tokens_estimate`: a token of source ``j`` reaches GPU ``g``
``hit[j, g] = T_j * (1 - exp(u[j, g]))`` times, ``u[j, g] = sum_e log(1 - q[j, e]) * a[e, g] / A[e]``
(``q = x / T``), and every DeepEP link load is a non-negative sum of such hits and of node hits. Since copies
stay in the expert's home node, each expert's node share is fixed and the node hits (the RDMA volumes) are
constants; only the NVLink hits depend on the split, each a concave function of the linear ``u``. Its tangent
at the incumbent split is an affine upper bound, exact there, and the communication time is non-decreasing in
every link load, so the MILP with the tangents in place of the hits minimises a majorizer of the true
objective that touches it at the incumbent. Hence
``F(new) <= F_hat(new) <= F_hat(incumbent) = F(incumbent)``: every exactly solved iterate's true objective
(linearised compute plus :meth:`~relibra.cost.model.CostModel.moe_comm_time`, the simulator's own price) is no
higher than the last (Lange, Hunter and Yang 2000, "Optimization transfer using surrogate objective
functions"; the same argument as the concave-convex procedure). Under the overlap ``F`` is the share of the
overlapped layer time, non-decreasing in the communication time, so the same holds. The loop starts from the
alltoall-proxy solution (the model above with alltoall's traffic) or a given ``start``, re-linearises at each
new solution, and stops when a solve lowers the true objective by less than :attr:`MajorizeConfig.rel_tol` of
it, or after :attr:`MajorizeConfig.max_iterations` solves; a solve that does not lower it (possible when a
gap-limited MILP returns a worse incumbent than its hint, or by a solver tolerance) is not accepted, so the
result is never worse than its start (the alltoall-proxy plan) priced under ``deepep``. The result is a fixed
point of the linearisation, not a proven optimum: ``bound_s`` comes from a second model with each hit replaced
by its chord over the range ``[U, 0]`` that ``u`` can take (a concave function lies above its chord, so this
minorizes the true objective everywhere) and is a valid lower bound; ``optimal`` says whether that bound
proves the result within ``relative_gap``. ``iterates_s`` lists the true objective of the start and of every
solve.

:func:`solve_replication` solves the MILP (OR-Tools ``pywraplp``: SCIP by default, CBC also works) with a
time limit and reports the proven bound; :func:`solve_split` solves the LP with the replica set fixed
(GLOP), the general-case token split of the greedy (:mod:`relibra.planners.replicate.greedy`), under either
dispatcher.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours
from relibra.planners.protocols import BatchContext, Replication
from relibra.planners.replicate.milp_model import (
    _alltoall_model,
    _deepep_model,
    _milp,
    _Problem,
    _problem,
    _Raw,
    dispatch_routing,
)
from relibra.planners.replicate.terms import round_assign

__all__ = [
    "MajorizeConfig",
    "MilpConfig",
    "MilpReplicator",
    "ReplicationSolution",
    "solve_replication",
    "solve_split",
]

MIP_SOLVERS = ("SCIP", "CBC")
"""OR-Tools backends that solve the replication MILP (both ship with the ``ortools`` wheel)."""


@dataclass(frozen=True)
class MajorizeConfig:
    """Majorize-minimize settings for ``cluster.dispatcher=deepep`` (module doc). These defaults are the only
    ones: the Hydra node ``planner/majorize/mm`` is generated from them
    (:mod:`experiments.config.planner_nodes`)."""

    max_iterations: int = 8
    """Linearised solves after the alltoall-proxy start, each re-linearised at the incumbent."""
    rel_tol: float = 1e-4
    """Stop once a solve lowers the true deepep objective by less than this fraction of it."""

    def __post_init__(self) -> None:
        if not (isinstance(self.max_iterations, int) and self.max_iterations >= 1):
            raise ValueError(f"max_iterations={self.max_iterations!r}; expected an integer >= 1")
        if not (math.isfinite(self.rel_tol) and self.rel_tol >= 0):
            raise ValueError(f"rel_tol={self.rel_tol!r}; expected a finite number >= 0")


@dataclass(frozen=True)
class ReplicationSolution:
    """One problem solved by the MILP or the LP split."""

    assign: np.ndarray
    """float64 [E, G]: tokens of expert ``e`` computed on GPU ``g`` (not rounded)."""
    copies: np.ndarray
    """bool [E, G]: GPUs holding a copy of ``e`` (home or replica slot)."""
    compute_tokens: np.ndarray
    """float64 [G]: linearised compute per GPU in token equivalents (fixed cost of every copy included)."""
    objective_s: float
    """``T_MoE`` of ``assign`` in seconds (latency included): linearised compute plus the cost model's
    communication (:meth:`CostModel.moe_comm_time`, either dispatcher); under the overlap (``overlap``
    given) the micro-batch's share of the overlapped layer time of these two terms
    (:func:`relibra.cost.overlap.microbatch_share`, attention added to the compute)."""
    bound_s: float
    """Proven lower bound on the optimum in seconds (``objective_s`` when solved to optimality as an LP)."""
    optimal: bool
    """The solver proved ``objective_s`` within the relative gap of the optimum."""
    wall_s: float
    iterates_s: tuple[float, ...] = ()
    """``deepep``: true objective (seconds) of the start (the alltoall-proxy solution or the given one) and
    of every linearised solve, in order (majorize-minimize); ``alltoall``: empty."""

    @property
    def gap(self) -> float:
        """Relative gap ``(objective - bound) / objective`` that the solver proved."""
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s) if self.objective_s > 0 else 0.0


def _full(p: _Problem, raw: _Raw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(assign float64 [E, G], copies bool [E, G], compute token equivalents float64 [G]) of a run."""
    g_n = p.x.shape[0]
    assign = np.zeros((p.x.shape[1], g_n))
    copies = np.zeros((p.x.shape[1], g_n), dtype=bool)
    np.put_along_axis(assign, p.gpu_of, raw.a, axis=1)
    np.put_along_axis(copies, p.gpu_of, raw.held, axis=1)
    return assign, copies, assign.sum(axis=0) + p.coef.fixed_tokens * copies.sum(axis=0)


def _true_s(p: _Problem, cost: CostModel, raw: _Raw) -> float:
    """Seconds of a run: linearised compute and the cost model's communication (its dispatcher), summed or
    under the overlap combined into the share (:meth:`_Problem.price_s`)."""
    assign, _, compute = _full(p, raw)
    comm = float(cost.moe_comm_time(p.x, assign).max())
    return p.price_s(float(compute.max()) * p.coef.seconds_per_token, comm)


def _start(p: _Problem, start: ReplicationSolution, replica_slots: int) -> _Raw:
    """A given solution as the loop's first incumbent (positions outside the home node dropped). A copy of
    the start that it gives no tokens is dropped too, as its plan drops it (:class:`MilpReplicator` keeps
    the replicas with tokens) and as :func:`~relibra.planners.replicate.greedy.linear_objective` prices it:
    the first iterate is the start plan's price, with no fixed cost for an empty copy."""
    a = np.take_along_axis(np.asarray(start.assign, dtype=np.float64), p.gpu_of, axis=1)
    given = np.take_along_axis(np.asarray(start.copies, dtype=bool), p.gpu_of, axis=1) & p.active & (a > 0)
    held = given | p.is_home
    a = np.where(held, np.maximum(a, 0.0), 0.0)
    if not np.allclose(a.sum(axis=1), p.tot, rtol=1e-9, atol=1e-6):
        raise ValueError(
            "start: its assign must hold every expert's tokens on copies in the expert's home node "
            f"(start.assign sums {a.sum(axis=1).tolist()} there, loads {p.tot.tolist()})"
        )
    used = np.bincount(p.gpu_of[held & ~p.is_home], minlength=p.x.shape[0])
    if p.mip and used.max(initial=0) > replica_slots:
        raise ValueError(
            f"start: a GPU holds {int(used.max())} replicas, more than replica_slots={replica_slots}"
        )
    return _Raw(a=a, held=held, value=np.nan, bound=np.nan, optimal=False)


def _solve(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    copies: np.ndarray | None,
    solver_name: str,
    time_limit_s: float,
    relative_gap: float,
    routing: np.ndarray | None,
    comm: bool = True,
    majorize: MajorizeConfig | None = None,
    start: ReplicationSolution | None = None,
    overlap: OverlapNeighbours | None = None,
) -> ReplicationSolution:
    t0 = time.perf_counter()
    if overlap is not None and not comm:
        raise ValueError("overlap: the overlapped share needs the communication term (comm=True)")
    p = _problem(x, home, cost, copies, overlap)
    g_n = p.x.shape[0]
    model = None
    if comm and g_n > 1:
        model = _alltoall_model(p, dispatch_routing(cost) if routing is None else routing)
    scale = p.coef.seconds_per_token
    # NOTE: under the overlap the latency is inside the share's pieces (:func:`_share_pieces`).
    lat = p.coef.latency * scale if comm and overlap is None else 0.0
    if model is None or cost.dispatcher == "alltoall":
        run = _milp(p, model, replica_slots, solver_name, time_limit_s, relative_gap)
        assign, copies_out, compute = _full(p, run)
        return ReplicationSolution(
            assign=assign,
            copies=copies_out,
            compute_tokens=compute,
            objective_s=run.value * scale + lat,
            bound_s=min(run.bound, run.value) * scale + lat,
            optimal=run.optimal,
            wall_s=time.perf_counter() - t0,
        )
    # deepep: majorize-minimize from the alltoall-proxy solution (module doc) or the given start
    mm = majorize if majorize is not None else MajorizeConfig()
    if start is None:
        best = _milp(p, model, replica_slots, solver_name, time_limit_s, relative_gap)
    else:
        best = _start(p, start, replica_slots)
    best_s = _true_s(p, cost, best)
    iterates = [best_s]
    for _ in range(mm.max_iterations):
        tangent = _deepep_model(p, cost, cost.share(_full(p, best)[0]))
        cand = _milp(p, tangent, replica_slots, solver_name, time_limit_s, relative_gap, hint=best)
        cand_s = _true_s(p, cost, cand)
        iterates.append(cand_s)
        improved = cand_s < best_s * (1.0 - mm.rel_tol)
        if cand_s < best_s:
            best, best_s = cand, cand_s
        if not improved:
            break
    chord = _milp(p, _deepep_model(p, cost, None), replica_slots, solver_name, time_limit_s, relative_gap)
    bound_s = min(chord.bound * scale + lat, best_s)
    assign, copies_out, compute = _full(p, best)
    return ReplicationSolution(
        assign=assign,
        copies=copies_out,
        compute_tokens=compute,
        objective_s=best_s,
        bound_s=bound_s,
        optimal=best_s - bound_s <= relative_gap * best_s,
        wall_s=time.perf_counter() - t0,
        iterates_s=tuple(iterates),
    )


@dataclass(frozen=True)
class MilpConfig:
    """Settings of :class:`MilpReplicator`. These defaults are the only ones: the Hydra node
    ``planner/replicate/milp`` is generated from them (:mod:`experiments.config.planner_nodes`)."""

    solver: str = "SCIP"
    """OR-Tools MIP backend: ``SCIP`` or ``CBC``."""
    time_limit_s: float = 10.0
    """Solver time limit per solve (alltoall: one per (micro-batch, layer) problem; deepep: the start, each
    linearised solve and the bound, so up to ``majorize.max_iterations + 2`` per problem)."""
    relative_gap: float = 1e-3
    """Stop once the incumbent is proven within this relative gap of the bound."""
    refill_aware: bool = True
    """Behind a planner, keep only copies that pay for their replica-buffer refill
    (:func:`relibra.planners.refill.replicate_within_window`); False: ``T_MoE`` alone."""

    def __post_init__(self) -> None:
        if self.solver not in MIP_SOLVERS:
            raise ValueError(f"solver={self.solver!r}; expected one of {list(MIP_SOLVERS)}")
        if not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s={self.time_limit_s!r}; expected seconds > 0")
        if not self.relative_gap >= 0:
            raise ValueError(f"relative_gap={self.relative_gap!r}; expected >= 0")


def solve_replication(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    solver: str = MilpConfig.solver,
    time_limit_s: float = MilpConfig.time_limit_s,
    relative_gap: float = MilpConfig.relative_gap,
    routing: np.ndarray | None = None,
    comm: bool = True,
    majorize: MajorizeConfig | None = None,
    start: ReplicationSolution | None = None,
    overlap: OverlapNeighbours | None = None,
) -> ReplicationSolution:
    """Optimal replicas and split of one problem (MILP). x [G, E], home [E].

    ``routing`` (from :func:`dispatch_routing`) may be passed to reuse it across problems of one cluster.
    Past ``time_limit_s`` the best solution found is returned with ``optimal=False`` and its proven bound.
    ``comm=False`` drops the communication term (objective ``T_comp`` only; then ``objective_s`` and
    ``bound_s`` hold compute seconds). Under ``deepep`` every solve runs within ``time_limit_s``, and
    ``majorize`` (None: :class:`MajorizeConfig`'s defaults) sets the majorize-minimize loop (module doc),
    which starts from ``start`` (a solution of this problem, e.g. the alltoall MILP's or the greedy's as
    assign / copies) or, if None, from the alltoall-proxy solution it solves first. ``overlap`` (one row:
    this problem's micro-batch's attention and neighbours) makes the objective its share of the overlapped
    layer time (module doc); ``objective_s`` and ``bound_s`` are then shares.
    """
    return _solve(
        x,
        home,
        cost,
        replica_slots,
        None,
        solver,
        time_limit_s,
        relative_gap,
        routing,
        comm,
        majorize,
        start,
        overlap,
    )


def solve_split(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    copies: np.ndarray,
    *,
    solver: str = "GLOP",
    routing: np.ndarray | None = None,
    majorize: MajorizeConfig | None = None,
    overlap: OverlapNeighbours | None = None,
) -> ReplicationSolution:
    """Optimal token split (LP) for a fixed replica set. x [G, E], home [E], copies bool [E, G].

    Copies outside the expert's home node are ignored (ReLibra replicates within the node only). Under
    ``deepep`` the split is the majorize-minimize fixed point from the alltoall-proxy LP (module doc).
    ``overlap`` (one row) as in :func:`solve_replication`.
    """
    return _solve(x, home, cost, 0, copies, solver, 60.0, 0.0, routing, majorize=majorize, overlap=overlap)


def greedy_with_lp_split(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    max_tries: int = 4,
    rel_tol: float = 1e-9,
    overlap: OverlapNeighbours | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The incremental greedy with every candidate's split solved by :func:`solve_split`.

    x [P, G, E], home [P, E] -> assign int64 [P, E, G], replicas int64 [P, G, r]. ``overlap`` (one row per
    problem): every split minimises, and every move is judged by, the problem's share of the overlapped
    layer time.
    """
    p_n, g_n, e_n = x.shape
    gpn = cost.cluster.domain_gpus
    routing = dispatch_routing(cost) if g_n > 1 else None
    assign = np.zeros((p_n, e_n, g_n), dtype=np.int64)
    replicas = -np.ones((p_n, g_n, replica_slots), dtype=np.int64)
    for p in range(p_n):
        row = None if overlap is None else overlap.rows(np.array([p]))
        copies = np.arange(g_n) == home[p][:, None]
        slots: list[list[int]] = [[] for _ in range(g_n)]
        sol = solve_split(x[p], home[p], cost, copies, routing=routing, overlap=row)
        while replica_slots > 0:
            gstar = int(np.argmax(sol.compute_tokens))
            node = np.arange(gstar // gpn * gpn, (gstar // gpn + 1) * gpn)
            on = np.flatnonzero((sol.assign[:, gstar] > 0) & (home[p] // gpn == gstar // gpn))
            on = on[copies[on][:, node].sum(axis=1) < gpn]
            improved = False
            for e in on[np.argsort(-sol.assign[on, gstar], kind="stable")][:max_tries]:
                open_ = [g for g in node if not copies[e, g] and len(slots[g]) < replica_slots]
                if not open_:
                    continue
                target = min(open_, key=lambda g: sol.compute_tokens[g])
                trial = copies.copy()
                trial[e, target] = True
                new = solve_split(x[p], home[p], cost, trial, routing=routing, overlap=row)
                # NOTE: LP optima tie many GPUs at the compute max, so relieving one leaves the objective
                # flat; such a plateau move is kept when it lowers the bottleneck GPU without raising T_MoE.
                better = new.objective_s < sol.objective_s * (1.0 - rel_tol)
                plateau = new.objective_s <= sol.objective_s * (1.0 + 1e-12) and new.compute_tokens[
                    gstar
                ] < sol.compute_tokens[gstar] * (1.0 - rel_tol)
                if better or plateau:
                    sol, copies = new, trial
                    slots[target].append(int(e))
                    improved = True
                    break
            if not improved:
                break
        assign[p] = round_assign(sol.assign, x[p].sum(axis=0))
        for g in range(g_n):
            kept = [e for e in slots[g] if assign[p, e, g] > 0]
            replicas[p, g, : len(kept)] = kept
    return assign, replicas


@dataclass(frozen=True)
class MilpReplicator:
    """:class:`~relibra.planners.protocols.Replicator` solving every (micro-batch, layer) problem exactly,
    with
    ``replica_slots`` (``r``) slots per GPU and ``config`` (default: :class:`MilpConfig`'s).

    Stats: ``milp_gap_mean`` / ``milp_gap_max`` (proven relative gaps), ``milp_optimal_fraction``,
    ``milp_objective_s`` / ``milp_bound_s`` (sums over the layers), ``milp_solve_s``.
    """

    replica_slots: int
    config: MilpConfig = MilpConfig()
    majorize: MajorizeConfig = field(default_factory=MajorizeConfig)
    """The majorize-minimize loop under ``cluster.dispatcher=deepep`` (unused under ``alltoall``)."""
    _routing: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def refill_aware(self) -> bool:
        return self.config.refill_aware

    def with_slots(self, replica_slots: int) -> MilpReplicator:
        return replace(self, replica_slots=replica_slots)

    def replicate(
        self,
        load: np.ndarray,
        home: np.ndarray,
        ctx: BatchContext,
        overlap: OverlapNeighbours | None = None,
    ) -> Replication:
        """load [L, G, E], home [L, E] -> Replication with assign [L, E, G], replicas [L, G, r].

        ``overlap`` (one row per layer, under ``cluster.ep_overlap``): each layer's MILP minimises the
        micro-batch's share of the overlapped layer time (:func:`solve_replication`); the stats
        ``milp_objective_s`` / ``milp_bound_s`` are then sums of shares. None: each problem's ``T_MoE``.
        """
        cluster = ctx.cluster
        key = (cluster.num_domains, cluster.domain_gpus)
        if key not in self._routing and cluster.num_gpus > 1:
            self._routing[key] = dispatch_routing(ctx.cost)
        routing = self._routing.get(key)
        load = np.asarray(load)
        num_layers, g_n, e_n = load.shape
        assign = np.zeros((num_layers, e_n, g_n), dtype=np.int32)
        replicas = -np.ones((num_layers, g_n, self.replica_slots), dtype=np.int32)
        sols = []
        for l in range(num_layers):
            sol = solve_replication(
                load[l],
                home[l],
                ctx.cost,
                self.replica_slots,
                solver=self.config.solver,
                time_limit_s=self.config.time_limit_s,
                relative_gap=self.config.relative_gap,
                routing=routing,
                majorize=self.majorize,
                overlap=None if overlap is None else overlap.rows(np.array([l])),
            )
            sols.append(sol)
            assign[l] = round_assign(sol.assign, load[l].sum(axis=0))
            held = (assign[l] > 0) & (np.arange(g_n) != home[l][:, None])  # [E, G]
            for g in range(g_n):
                kept = np.flatnonzero(held[:, g])
                replicas[l, g, : kept.size] = kept
        gaps = np.array([s.gap for s in sols])
        stats = {
            "milp_gap_mean": float(gaps.mean()) if gaps.size else 0.0,
            "milp_gap_max": float(gaps.max()) if gaps.size else 0.0,
            "milp_optimal_fraction": float(np.mean([s.optimal for s in sols])) if sols else 1.0,
            "milp_objective_s": float(sum(s.objective_s for s in sols)),
            "milp_bound_s": float(sum(s.bound_s for s in sols)),
            "milp_solve_s": float(sum(s.wall_s for s in sols)),
        }
        return Replication(assign=assign, replicas=replicas, stats=stats)
