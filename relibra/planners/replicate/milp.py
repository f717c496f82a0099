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
* objective: ``t_comp + t_comm`` (plus the constant all-to-all latency).

This is exact for the cost model's ``alltoall`` communication and for its compute in the compute-bound
regime (the roofline's ``eff(n) = n / (n + h)`` makes an expert cost ``per_token * (n + h)``). The link
coefficients are taken from :meth:`~relibra.cost.model.CostModel.link_bytes` itself, so both can never drift
apart.

:func:`solve_replication` solves the MILP (OR-Tools ``pywraplp``: SCIP by default, CBC also works) with a
time limit and reports the proven bound; :func:`solve_split` solves the LP with the replica set fixed
(GLOP), the general-case token split of the greedy (:mod:`relibra.planners.replicate.greedy`). Neither models
``cluster.dispatcher=deepep``, whose de-duplicated traffic is concave in the split: they refuse it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
from ortools.linear_solver import pywraplp

from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours
from relibra.planners.protocols import BatchContext, Replication
from relibra.planners.replicate.terms import ReplicationCoefficients, round_assign

__all__ = [
    "MilpConfig",
    "MilpReplicator",
    "ReplicationSolution",
    "dispatch_routing",
    "solve_replication",
    "solve_split",
]

MIP_SOLVERS = ("SCIP", "CBC")
"""OR-Tools backends that solve the replication MILP (both ship with the ``ortools`` wheel)."""

LINK_KEYS = ("nvlink_send", "nvlink_recv", "nic_send", "nic_recv")


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
    """Linearised ``T_MoE`` of ``assign`` in seconds (latency included)."""
    bound_s: float
    """Proven lower bound on the optimum in seconds (``objective_s`` when solved to optimality as an LP)."""
    optimal: bool
    wall_s: float

    @property
    def gap(self) -> float:
        """Relative gap ``(objective - bound) / objective`` that the solver proved."""
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s) if self.objective_s > 0 else 0.0


def dispatch_routing(cost: CostModel) -> np.ndarray:
    """float64 [4, G(o), G(j), G(g)]: bytes on link class ``c`` of GPU ``o`` per byte sent ``j -> g``.

    Classes in the order of :data:`LINK_KEYS`. Built by applying :meth:`CostModel.link_bytes` to unit
    traffic, one source at a time (``G^4`` numbers in all: fine up to EP 64).
    """
    g_n = cost.cluster.num_gpus
    out = np.empty((4, g_n, g_n, g_n))
    diag = np.arange(g_n)
    for j in range(g_n):
        unit = np.zeros((g_n, g_n, g_n))
        unit[diag, j, diag] = 1.0  # unit[d] is one byte j -> d
        lb = cost.link_bytes(unit)  # each [G(d), G(o)]
        for c, key in enumerate(LINK_KEYS):
            out[c, :, j, :] = lb[key].T
    return out


def _link_coefficients(
    x: np.ndarray, tot: np.ndarray, gpu_of: np.ndarray, routing: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Link loads per token of ``a[e, k]``: (dispatch, combine) each float64 [4, G(o), E, gpn]."""
    share = np.divide(x, tot, out=np.zeros_like(x), where=tot > 0)  # [G(j), E]
    disp = np.einsum("cojg,je->coeg", routing, share, optimize=True)  # [4, G, E, G]
    comb = np.einsum("cogj,je->coeg", routing, share, optimize=True)
    idx = np.broadcast_to(gpu_of, disp.shape[:2] + gpu_of.shape)
    return np.take_along_axis(disp, idx, axis=-1), np.take_along_axis(comb, idx, axis=-1)


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
) -> ReplicationSolution:
    if comm and cost.dispatcher != "alltoall":
        raise ValueError(
            f"cluster.dispatcher={cost.dispatcher}: the replication MILP / LP split models alltoall's "
            "communication, which is linear in the split; DeepEP's de-duplicated traffic is not (a token "
            "reaches a GPU with probability 1 - prod (1 - q)^share, concave in the split). Use the greedy "
            "(split=waterfill), which prices deepep exactly as the simulator does"
        )
    t0 = time.perf_counter()
    cluster = cost.cluster
    g_n, gpn = cluster.num_gpus, cluster.gpus_per_node
    x = np.asarray(x, dtype=np.float64)
    home = np.asarray(home, dtype=np.int64)
    e_n = x.shape[1]
    if x.shape != (g_n, e_n) or home.shape != (e_n,):
        raise ValueError(f"x must be [G={g_n}, E] and home [E]; got {x.shape} and {home.shape}")
    coef = ReplicationCoefficients.from_cost(cost)
    h = coef.fixed_tokens
    tot = x.sum(axis=0)  # [E]
    gpu_of = (home // gpn * gpn)[:, None] + np.arange(gpn)  # [E, gpn]
    is_home = gpu_of == home[:, None]
    if copies is None:
        active = np.broadcast_to((tot > 0)[:, None], (e_n, gpn)) | is_home
    else:
        active = np.take_along_axis(np.asarray(copies, dtype=bool), gpu_of, axis=1) | is_home
    free = active & ~is_home & (tot[:, None] > 0)  # replica positions
    mip = copies is None

    solver = pywraplp.Solver.CreateSolver(solver_name)
    if solver is None:
        raise ValueError(f"OR-Tools solver {solver_name!r} is not available; use 'SCIP', 'CBC' or 'GLOP'")
    solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    inf = solver.infinity()
    a_var = np.empty((e_n, gpn), dtype=object)
    z_var = np.empty((e_n, gpn), dtype=object)
    for e, k in zip(*np.nonzero(active)):
        a_var[e, k] = solver.NumVar(0.0, float(tot[e]), f"a_{e}_{k}")
        if mip and free[e, k]:
            z_var[e, k] = solver.BoolVar(f"z_{e}_{k}")
    t_comp = solver.NumVar(0.0, inf, "t_comp")
    t_comm = solver.NumVar(0.0, inf, "t_comm")
    p_var = [[solver.NumVar(0.0, inf, f"p{ph}_{o}") for o in range(g_n)] for ph in range(2)]

    for e in range(e_n):  # conservation
        ct = solver.Constraint(float(tot[e]), float(tot[e]))
        for k in np.flatnonzero(active[e]):
            ct.SetCoefficient(a_var[e, k], 1.0)
    if mip:
        slot_ct = [solver.Constraint(-inf, float(replica_slots)) for _ in range(g_n)]
        for e, k in zip(*np.nonzero(free)):
            link = solver.Constraint(-inf, 0.0)  # a <= A z
            link.SetCoefficient(a_var[e, k], 1.0)
            link.SetCoefficient(z_var[e, k], -float(tot[e]))
            slot_ct[gpu_of[e, k]].SetCoefficient(z_var[e, k], 1.0)
    # compute: sum_e a[e, g] + h * (copies on g) <= t_comp
    fixed = np.zeros(g_n)
    np.add.at(fixed, home, h)
    if not mip:
        np.add.at(fixed, gpu_of[free], h)
    comp_ct = [solver.Constraint(-inf, -float(fixed[g])) for g in range(g_n)]
    for g in range(g_n):
        comp_ct[g].SetCoefficient(t_comp, -1.0)
    for e, k in zip(*np.nonzero(active)):
        comp_ct[gpu_of[e, k]].SetCoefficient(a_var[e, k], 1.0)
        if mip and free[e, k]:
            comp_ct[gpu_of[e, k]].SetCoefficient(z_var[e, k], h)
    # communication
    if comm and g_n > 1:
        routing = dispatch_routing(cost) if routing is None else routing
        weights = np.array([coef.nvlink_per_token] * 2 + [coef.nic_per_token] * 2)
        for ph, kc in enumerate(_link_coefficients(x, tot, gpu_of, routing)):
            kc = kc * weights[:, None, None, None] * active  # [4, G, E, gpn]
            for c in range(4):
                for o in range(g_n):
                    nz = np.nonzero(kc[c, o])
                    if nz[0].size == 0:
                        continue
                    ct = solver.Constraint(-inf, 0.0)
                    ct.SetCoefficient(p_var[ph][o], -1.0)
                    for e, k, v in zip(*nz, kc[c, o][nz]):
                        ct.SetCoefficient(a_var[e, k], float(v))
        for o in range(g_n):
            ct = solver.Constraint(-inf, 0.0)
            ct.SetCoefficient(p_var[0][o], 2.0)
            ct.SetCoefficient(p_var[1][o], 2.0)
            ct.SetCoefficient(t_comm, -1.0)
    obj = solver.Objective()
    obj.SetCoefficient(t_comp, 1.0)
    obj.SetCoefficient(t_comm, 1.0)
    obj.SetMinimization()

    params = pywraplp.MPSolverParameters()
    if mip:
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
    status = solver.Solve(params)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        raise RuntimeError(
            f"{solver_name} found no feasible replication within {time_limit_s} s (status {status})"
        )
    a = np.zeros((e_n, gpn))
    for e, k in zip(*np.nonzero(active)):
        a[e, k] = a_var[e, k].solution_value()
    held = active.copy()
    if mip:
        for e, k in zip(*np.nonzero(free)):
            held[e, k] = z_var[e, k].solution_value() > 0.5
    a = np.where(held, np.maximum(a, 0.0), 0.0)
    assign = np.zeros((e_n, g_n))
    copies_out = np.zeros((e_n, g_n), dtype=bool)
    np.put_along_axis(assign, gpu_of, a, axis=1)
    np.put_along_axis(copies_out, gpu_of, held, axis=1)
    compute = assign.sum(axis=0) + h * copies_out.sum(axis=0)
    value = obj.Value()
    bound = obj.BestBound() if mip else value
    scale = coef.seconds_per_token
    lat = coef.latency * scale if comm else 0.0
    return ReplicationSolution(
        assign=assign,
        copies=copies_out,
        compute_tokens=compute,
        objective_s=value * scale + lat,
        bound_s=min(bound, value) * scale + lat,
        optimal=status == pywraplp.Solver.OPTIMAL,
        wall_s=time.perf_counter() - t0,
    )


def solve_replication(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    solver: str = "SCIP",
    time_limit_s: float = 10.0,
    relative_gap: float = 1e-3,
    routing: np.ndarray | None = None,
    comm: bool = True,
) -> ReplicationSolution:
    """Optimal replicas and split of one problem (MILP). x [G, E], home [E].

    ``routing`` (from :func:`dispatch_routing`) may be passed to reuse it across problems of one cluster.
    Past ``time_limit_s`` the best solution found is returned with ``optimal=False`` and its proven bound.
    ``comm=False`` drops the communication term (objective ``T_comp`` only; then ``objective_s`` and
    ``bound_s`` hold compute seconds).
    """
    return _solve(x, home, cost, replica_slots, None, solver, time_limit_s, relative_gap, routing, comm)


def solve_split(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    copies: np.ndarray,
    *,
    solver: str = "GLOP",
    routing: np.ndarray | None = None,
) -> ReplicationSolution:
    """Optimal token split (LP) for a fixed replica set. x [G, E], home [E], copies bool [E, G].

    Copies outside the expert's home node are ignored (ReLibra replicates within the node only).
    """
    return _solve(x, home, cost, 0, copies, solver, 60.0, 0.0, routing)


def greedy_with_lp_split(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    max_tries: int = 4,
    rel_tol: float = 1e-9,
) -> tuple[np.ndarray, np.ndarray]:
    """The incremental greedy with every candidate's split solved by :func:`solve_split`.

    x [P, G, E], home [P, E] -> assign int64 [P, E, G], replicas int64 [P, G, r].
    """
    p_n, g_n, e_n = x.shape
    gpn = cost.cluster.gpus_per_node
    routing = dispatch_routing(cost) if g_n > 1 else None
    assign = np.zeros((p_n, e_n, g_n), dtype=np.int64)
    replicas = -np.ones((p_n, g_n, replica_slots), dtype=np.int64)
    for p in range(p_n):
        copies = np.arange(g_n) == home[p][:, None]
        slots: list[list[int]] = [[] for _ in range(g_n)]
        sol = solve_split(x[p], home[p], cost, copies, routing=routing)
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
                new = solve_split(x[p], home[p], cost, trial, routing=routing)
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
class MilpConfig:
    """Settings of :class:`MilpReplicator`. These defaults are the only ones: the Hydra node
    ``planner/replicate/milp`` is generated from them (:mod:`experiments.planner_nodes`)."""

    solver: str = "SCIP"
    """OR-Tools MIP backend: ``SCIP`` or ``CBC``."""
    time_limit_s: float = 10.0
    """Solver time limit per (micro-batch, layer) problem."""
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

        ``overlap`` is not in the MILP's objective (each problem's own ``T_MoE``); under
        ``cluster.ep_overlap`` :func:`relibra.planners.refill.replicate_batch` combines its answers by the
        overlapped time.
        """
        cluster = ctx.cluster
        key = (cluster.nodes, cluster.gpus_per_node)
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
