"""The replication MILP's model (OR-Tools ``pywraplp``): one (micro-batch, layer) problem, its link
coefficients taken from :meth:`~relibra.cost.model.CostModel.link_bytes`, alltoall's linear traffic and
DeepEP's tangent (majorizer) and chord (minorizer) models, and the builder of the MILP / LP with its
objective (``T_MoE``, or the share of the overlapped layer time). The method is described in
:mod:`relibra.planners.replicate.milp`, which solves it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from relibra import numerics
from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours, microbatch_share, share_pieces
from relibra.planners.reorder.links import NUM_LINKS, deepep_routes
from relibra.planners.replicate.terms import ReplicationCoefficients

__all__ = ["LINK_KEYS", "LinkModel", "deepep_link_model", "dispatch_routing"]

LINK_KEYS = ("nvlink_send", "nvlink_recv", "nic_send", "nic_recv")


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


@dataclass(frozen=True)
class LinkModel:
    """Affine link loads of one problem in token equivalents (per-token link time already applied):
    ``load[ph, c, o] = const[ph, c, o] + sum_{e, k} coef[ph, c, o, e, k] * a[e, k]``."""

    coef: np.ndarray
    """float64 [2 (dispatch, combine), 4 (:data:`LINK_KEYS`), G(o), E, gpn]: per token of ``a[e, k]``."""
    const: np.ndarray
    """float64 [2, 4, G(o)]: the part that does not depend on the split."""

    def comm_tokens(self, a: np.ndarray) -> np.ndarray:
        """a [E, gpn] -> float64 [G]: ``2 * (busiest dispatch link + busiest combine link)`` of each GPU (the
        four phases; latency excluded)."""
        loads = self.const + np.einsum("pcoek,ek->pco", self.coef, a)
        return 2.0 * loads.max(axis=1).sum(axis=0)


@dataclass(frozen=True)
class _Problem:
    """One (micro-batch, layer) problem, its copy positions, in the home node of every expert."""

    x: np.ndarray
    """float64 [G(j), E]."""
    home: np.ndarray
    """int64 [E]."""
    tot: np.ndarray
    """float64 [E]: ``A[e]``."""
    gpu_of: np.ndarray
    """int64 [E, gpn]: the GPUs of ``e``'s home node."""
    is_home: np.ndarray
    """bool [E, gpn]."""
    active: np.ndarray
    """bool [E, gpn]: positions that may compute ``e``."""
    free: np.ndarray
    """bool [E, gpn]: replica positions (a binary each in the MILP)."""
    mip: bool
    coef: ReplicationCoefficients
    overlap: OverlapNeighbours | None = None
    """One row: the micro-batch's attention and neighbours (seconds) under ``cluster.ep_overlap``; None: the
    objective is ``T_MoE``."""

    def price_s(self, compute_s: float, comm_s: float) -> float:
        """The objective in seconds of compute (linearised, busiest GPU) and all-to-all (latency included)
        seconds: their sum, or under the overlap the micro-batch's share."""
        if self.overlap is None:
            return compute_s + comm_s
        return microbatch_share(
            compute_s + float(self.overlap.attention[0]),
            comm_s,
            self.overlap.neighbours[0],
            math.inf,
            self.overlap.contention,
        )


def _share_pieces(overlap: OverlapNeighbours, coef: ReplicationCoefficients) -> np.ndarray:
    """float64 [4, 2, 3]: :func:`relibra.cost.overlap.share_pieces` of ``overlap``'s one row in token
    equivalents of ``(t_comp, t_comm, 1)``, the attention and the all-to-all latency moved into the
    constants."""
    spt = coef.seconds_per_token
    pieces = share_pieces(overlap.neighbours[0] / spt, overlap.contention)
    att = float(overlap.attention[0]) / spt
    pieces[..., 2] += pieces[..., 0] * att + pieces[..., 1] * coef.latency
    return pieces


def _problem(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    copies: np.ndarray | None,
    overlap: OverlapNeighbours | None = None,
) -> _Problem:
    cluster = cost.cluster
    g_n, gpn = cluster.num_gpus, cluster.domain_gpus
    x = np.asarray(x, dtype=np.float64)
    home = np.asarray(home, dtype=np.int64)
    e_n = x.shape[1]
    if x.shape != (g_n, e_n) or home.shape != (e_n,):
        raise ValueError(f"x must be [G={g_n}, E] and home [E]; got {x.shape} and {home.shape}")
    tot = x.sum(axis=0)  # [E]
    gpu_of = (home // gpn * gpn)[:, None] + np.arange(gpn)  # [E, gpn]
    is_home = gpu_of == home[:, None]
    if copies is None:
        active = np.broadcast_to((tot > 0)[:, None], (e_n, gpn)) | is_home
    else:
        active = np.take_along_axis(np.asarray(copies, dtype=bool), gpu_of, axis=1) | is_home
    free = active & ~is_home & (tot[:, None] > 0)
    if overlap is not None and overlap.attention.shape != (1,):
        raise ValueError(f"overlap has {overlap.attention.shape[0]} rows; expected one (this problem's)")
    coef = ReplicationCoefficients.from_cost(cost)
    return _Problem(x, home, tot, gpu_of, is_home, active, free, copies is None, coef, overlap)


def _link_coefficients(
    x: np.ndarray, tot: np.ndarray, gpu_of: np.ndarray, routing: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Link loads per token of ``a[e, k]``: (dispatch, combine) each float64 [4, G(o), E, gpn]."""
    share = np.divide(x, tot, out=np.zeros_like(x), where=tot > 0)  # [G(j), E]
    disp = np.einsum("cojg,je->coeg", routing, share, optimize=True)  # [4, G, E, G]
    comb = np.einsum("cogj,je->coeg", routing, share, optimize=True)
    idx = np.broadcast_to(gpu_of, disp.shape[:2] + gpu_of.shape)
    return np.take_along_axis(disp, idx, axis=-1), np.take_along_axis(comb, idx, axis=-1)


def _alltoall_model(p: _Problem, routing: np.ndarray) -> LinkModel:
    """alltoall's link loads, linear in the split under the proportional split rule (module doc)."""
    c = p.coef
    weights = np.array([c.nvlink_per_token] * 2 + [c.nic_per_token] * 2)
    kcs = [
        kc * (weights * scale)[:, None, None, None] * p.active
        for kc, scale in zip(
            _link_coefficients(p.x, p.tot, p.gpu_of, routing), (c.dispatch_scale, 1.0), strict=True
        )
    ]
    return LinkModel(coef=np.stack(kcs), const=np.zeros((2, 4, p.x.shape[0])))


def _deepep_weights(cost: CostModel) -> np.ndarray:
    """float64 [2, 4]: token equivalents per token on each link class in a dispatch and a combine phase,
    read from :meth:`CostModel.deepep_phase_times` itself."""
    out = np.empty((2, 4))
    for c, key in enumerate(LINK_KEYS):
        unit = {k: np.array([1.0 if k == key else 0.0]) for k in LINK_KEYS}
        dispatch, combine = cost.deepep_phase_times(unit)
        out[:, c] = dispatch[0], combine[0]
    return out / ReplicationCoefficients.from_cost(cost).seconds_per_token


def _deepep_model(p: _Problem, cost: CostModel, share: np.ndarray | None) -> LinkModel:
    """DeepEP's link loads (the cost model's estimate) bounded by affine functions of the split.

    A token of source ``j`` reaches GPU ``g`` ``hit[j, g] = T_j * (1 - exp(u[j, g]))`` times, with
    ``u[j, g] = sum_e log(1 - q[j, e]) * a[e, g] / A[e]``
    (:func:`relibra.cost.fabric.deepep_link_tokens_estimate`), concave in ``u``. ``share`` [E, G] given: its
    tangent at ``u0 = u(share)``, an upper bound exact at ``share``; None: its chord over ``[U, 0]``,
    ``U`` the least ``u`` any split reaches (every copy position of ``g`` at share 1), a lower bound.
    Node hits do not depend on the split (copies stay in the home node).
    """
    cluster = cost.cluster
    g_n, gpn, nodes = cluster.num_gpus, cluster.domain_gpus, cluster.num_domains
    x, tot = p.x, p.tot
    tok = x.sum(axis=1) / cost.model.top_k  # [G(j)]
    q = np.minimum(np.divide(x, tok[:, None], out=np.zeros_like(x), where=tok[:, None] > 0), 1.0)
    lq = numerics.log1p(-np.minimum(q, 1.0 - 1e-12))  # [G(j), E], as the fabric's estimate
    if share is None:
        reach = np.zeros((x.shape[1], g_n))
        np.put_along_axis(reach, p.gpu_of, p.active.astype(np.float64), axis=1)
        low = numerics.matmul(lq, reach)  # [G(j), G(g)]
        neg = low < 0
        c1 = np.where(neg, tok[:, None] * -numerics.expm1(low) / np.where(neg, low, -1.0), 0.0)
        c0 = np.zeros_like(c1)
    else:
        u0 = numerics.matmul(lq, np.asarray(share, dtype=np.float64))
        e0 = numerics.exp(u0)
        c1 = -tok[:, None] * e0  # f'(u0)
        c0 = tok[:, None] * (1.0 - e0 * (1.0 - u0))  # f(u0) - f'(u0) * u0
    node_share = np.zeros((x.shape[1], nodes))
    node_share[np.arange(x.shape[1]), p.home // gpn] = tot > 0
    hit_node = tok[:, None] * -numerics.expm1(numerics.matmul(lq, node_share))  # [G(j), N]
    gidx, gcnt, nidx, ncnt = deepep_routes(nodes, gpn)
    rg = np.zeros((NUM_LINKS * g_n, g_n, g_n))  # [slot * G + o, j, g]
    rn = np.zeros((NUM_LINKS * g_n, g_n, nodes))
    for idx, cnt, r in ((gidx, gcnt, rg), (nidx, ncnt, rn)):
        jj, gg = np.nonzero(cnt)
        for k in range(idx.shape[-1]):
            np.add.at(r, (idx[jj, gg, k], jj, gg), 1.0)
    const = np.einsum("rjg,jg->r", rg, c0) + np.einsum("rjb,jb->r", rn, hit_node)
    per_a = np.divide(lq, tot[None, :], out=np.zeros_like(lq), where=tot[None, :] > 0)  # du / da [G(j), E]
    full = np.einsum("rjg,je->reg", rg * c1[None], per_a, optimize=True)  # [slot * G + o, E, G(g)]
    idx_k = np.broadcast_to(p.gpu_of, full.shape[:1] + p.gpu_of.shape)
    coef = np.take_along_axis(full, idx_k, axis=-1) * p.active  # [slot * G + o, E, gpn]
    w = _deepep_weights(cost)[:, :, None]
    return LinkModel(
        coef=coef.reshape(2, 4, g_n, *p.gpu_of.shape) * w[..., None, None],
        const=const.reshape(2, 4, g_n) * w,
    )


def deepep_link_model(
    x: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    share: np.ndarray | None,
    copies: np.ndarray | None = None,
) -> LinkModel:
    """The affine bounds of :func:`_deepep_model` for one problem: x [G, E], home [E], share [E, G] (the
    tangent point; None: the chord, a lower bound), copies bool [E, G] (None: every GPU of the home node)."""
    return _deepep_model(_problem(x, home, cost, copies), cost, share)


@dataclass(frozen=True)
class _Raw:
    """One solver run: the split on the copy positions and the solver's own values (token equivalents)."""

    a: np.ndarray
    """float64 [E, gpn]."""
    held: np.ndarray
    """bool [E, gpn]."""
    value: float
    bound: float
    optimal: bool


def _milp(
    p: _Problem,
    model: LinkModel | None,
    replica_slots: int,
    solver_name: str,
    time_limit_s: float,
    relative_gap: float,
    hint: _Raw | None = None,
) -> _Raw:
    """Build and solve the MILP (``p.mip``) or the LP of one problem with communication ``model``."""
    g_n = p.x.shape[0]
    e_n = p.x.shape[1]
    h = p.coef.fixed_tokens
    tot, gpu_of, active, free, mip = p.tot, p.gpu_of, p.active, p.free, p.mip
    solver = pywraplp.Solver.CreateSolver(solver_name)
    if solver is None:
        raise ValueError(f"OR-Tools solver {solver_name!r} is not available; use 'SCIP', 'CBC' or 'GLOP'")
    solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    inf = solver.infinity()
    gpn = gpu_of.shape[1]
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
    np.add.at(fixed, p.home, h)
    if not mip:
        np.add.at(fixed, gpu_of[free], h)
    comp_ct = [solver.Constraint(-inf, -float(fixed[g])) for g in range(g_n)]
    for g in range(g_n):
        comp_ct[g].SetCoefficient(t_comp, -1.0)
    for e, k in zip(*np.nonzero(active)):
        comp_ct[gpu_of[e, k]].SetCoefficient(a_var[e, k], 1.0)
        if mip and free[e, k]:
            comp_ct[gpu_of[e, k]].SetCoefficient(z_var[e, k], h)
    # communication: p[ph][o] >= each link load of GPU o in exchange ph; t_comm >= 2 (p[0][o] + p[1][o])
    if model is not None:
        for ph in range(2):
            kc, cst = model.coef[ph], model.const[ph]
            for c in range(4):
                for o in range(g_n):
                    nz = np.nonzero(kc[c, o])
                    if nz[0].size == 0 and cst[c, o] == 0.0:
                        continue
                    ct = solver.Constraint(-inf, -float(cst[c, o]))
                    ct.SetCoefficient(p_var[ph][o], -1.0)
                    for e, k, v in zip(*nz, kc[c, o][nz]):
                        ct.SetCoefficient(a_var[e, k], float(v))
        for o in range(g_n):
            ct = solver.Constraint(-inf, 0.0)
            ct.SetCoefficient(p_var[0][o], 2.0)
            ct.SetCoefficient(p_var[1][o], 2.0)
            ct.SetCoefficient(t_comm, -1.0)
    obj = solver.Objective()
    const = 0.0
    if p.overlap is None:
        obj.SetCoefficient(t_comp, 1.0)
        obj.SetCoefficient(t_comm, 1.0)
    else:  # the share: sum over pieces of max_i (a_i t_comp + b_i t_comm + c_i) (relibra.cost.overlap)
        w_comp = w_comm = 0.0
        for i, piece in enumerate(_share_pieces(p.overlap, p.coef)):
            args = piece[np.isfinite(piece[:, 2])]
            if args.shape[0] == 1:  # no max: the affine term itself
                w_comp, w_comm, const = w_comp + args[0, 0], w_comm + args[0, 1], const + args[0, 2]
                continue
            s_var = solver.NumVar(-inf, inf, f"share_{i}")
            obj.SetCoefficient(s_var, 1.0)
            for a, b, c in args:  # s >= a t_comp + b t_comm + c
                ct = solver.Constraint(float(c), inf)
                ct.SetCoefficient(s_var, 1.0)
                ct.SetCoefficient(t_comp, -float(a))
                ct.SetCoefficient(t_comm, -float(b))
        obj.SetCoefficient(t_comp, w_comp)
        obj.SetCoefficient(t_comm, w_comm)
    obj.SetMinimization()
    if hint is not None and mip:
        pos = list(zip(*np.nonzero(active)))
        rep = list(zip(*np.nonzero(free)))
        solver.SetHint(
            [a_var[e, k] for e, k in pos] + [z_var[e, k] for e, k in rep],
            [float(hint.a[e, k]) for e, k in pos] + [float(hint.held[e, k]) for e, k in rep],
        )

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
    value = obj.Value() + const
    return _Raw(
        a=np.where(held, np.maximum(a, 0.0), 0.0),
        held=held,
        value=value,
        bound=obj.BestBound() + const if mip else value,
        optimal=status == pywraplp.Solver.OPTIMAL,
    )
