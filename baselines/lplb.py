"""LPLB+: DeepSeek's linear-programming load balancer, with oracle per-micro-batch loads.

Source: deepseek-ai/LPLB (README "How LPLB Works" and ``lplb/planner.py``). The mechanism:

1. **Placement**: EPLB with replication switched off (reordering only:
   :func:`baselines.eplb.rebalance_experts` with ``E`` physical experts); each GPU's experts are then
   ordered by load, heaviest first.
2. **Redundant copies along a fixed topology**: LPLB's ``r2o`` matrix ``[G, D]`` says that redundant slot
   ``j`` of GPU ``i`` holds a copy of the ``j``-th heaviest expert of GPU ``r2o[i, j]``; every column is a
   permutation, so each expert has at most two copies (LPLB asserts this) and every copy is an edge
   ``r2o[i, j] -> i`` of the topology graph. With ``R = c * D`` redundant slots, block ``c`` copies the
   experts at positions ``c * D .. c * D + D - 1`` (LPLB's "combined" redundant experts).
   Topologies (:func:`redundant_to_original`): ``ring`` (D = 1, GPU ``i`` copies from ``i - 1``),
   ``cube`` (LPLB's Cube8P2E example, groups of 8, D = 2), ``hypercube`` (groups of 16, D = 4,
   ``i ^ 2**j``), ``torus`` (D = 2: the previous GPU of the node and the same rail of the previous node).
3. **Per micro-batch LP** ("+": the micro-batch's exact loads): the tokens of every replicated expert are
   split between original and copy to minimise the maximum GPU load,
   ``min t  s.t.  base_g - sum_{p: orig=g} f_p + sum_{p: copy=g} f_p <= t,  0 <= f_p <= tokens(e_p)``.
   ``solver="highs"`` solves it exactly (all (micro-batch, layer) problems in one block-diagonal LP);
   ``solver="ipm"`` reproduces LPLB's few-iteration interior-point solve (:func:`ipm_split`, a batched
   Mehrotra predictor-corrector stopped after ``ipm_iterations``) and reports its gap to the exact LP.

Placement and copy selection use this batch's loads (``load_mode="oracle"``) or the moving average of
earlier batches (``"history"``, as LPLB runs). LPLB balances token counts only (no GEMM non-linearity, no
communication cost), which is kept. Redundant slots hold weights permanently in every layer
(``L * R`` experts per GPU, ``stats["redundant_bytes_per_gpu"]``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import highspy
import numpy as np

from baselines.eplb import history_weight, rebalance_experts
from relibra.cluster import ClusterSpec
from relibra.planners.protocols import BatchContext, SlotBudget, home_assign
from relibra.relabel import relabel_for
from relibra.types import BatchPlan

__all__ = [
    "TOPOLOGIES",
    "LplbPlacement",
    "LplbPlanner",
    "auto_topology",
    "exact_split",
    "ipm_split",
    "lplb_placement",
    "max_load",
    "redundant_to_original",
    "topology_edges",
]

Topology = Literal["ring", "cube", "hypercube", "torus", "auto"]
TOPOLOGIES: tuple[str, ...] = ("ring", "cube", "hypercube", "torus")


def auto_topology(nodes: int, gpus_per_node: int) -> str:
    """torus across several nodes, cube inside one node of 8 or more GPUs, ring otherwise."""
    if nodes >= 2 and gpus_per_node >= 2:
        return "torus"
    return "cube" if (nodes * gpus_per_node) % 8 == 0 else "ring"


# LPLB README's Cube8P2E example, transposed to [8 GPUs, 2 redundant slots].
_CUBE8 = np.array([[3, 0, 1, 2, 7, 4, 5, 6], [6, 7, 4, 5, 0, 1, 2, 3]]).T


def redundant_to_original(topology: str, nodes: int, gpus_per_node: int) -> np.ndarray:
    """LPLB's ``r2o`` over the whole EP group: int64 [G, D], GPU whose ``j``-th expert GPU ``i`` copies.

    ``cube`` and ``hypercube`` tile the group with independent blocks of 8 and 16 consecutive GPUs.
    """
    g = nodes * gpus_per_node
    gpu = np.arange(g)
    if topology == "auto":
        topology = auto_topology(nodes, gpus_per_node)
    if topology == "ring":
        if g < 2:
            raise ValueError(f"topology=ring needs at least 2 GPUs, got G={g}")
        return ((gpu - 1) % g)[:, None]
    if topology in ("cube", "hypercube"):
        size = 8 if topology == "cube" else 16
        if g % size != 0:
            raise ValueError(f"topology={topology} needs G to be a multiple of {size}, got G={g}")
        block = _CUBE8 if topology == "cube" else np.arange(16)[:, None] ^ (1 << np.arange(4))[None, :]
        return (gpu // size * size)[:, None] + block[gpu % size]
    if topology == "torus":
        if nodes < 2 or gpus_per_node < 2:
            raise ValueError(
                f"topology=torus needs >= 2 nodes and >= 2 GPUs per node, got {nodes} x {gpus_per_node}"
            )
        node, rail = gpu // gpus_per_node, gpu % gpus_per_node
        in_node = node * gpus_per_node + (rail - 1) % gpus_per_node
        across = (node - 1) % nodes * gpus_per_node + rail
        return np.stack([in_node, across], axis=1)
    raise ValueError(f"topology={topology!r}; expected one of {TOPOLOGIES}")


def topology_edges(r2o: np.ndarray) -> set[tuple[int, int]]:
    """Directed edges ``(original GPU, copy GPU)`` of a topology. r2o [G, D] -> set of pairs."""
    copy, _ = np.indices(r2o.shape)
    return {(int(o), int(c)) for o, c in zip(r2o.ravel(), copy.ravel())}


@dataclass(frozen=True)
class LplbPlacement:
    """Placement and redundant copies of one batch.

    ``P = G * R`` edges; edge ``p`` is redundant slot ``p % R`` of GPU ``p // R``.
    """

    home: np.ndarray
    """int32 [L, E]: GPU of each expert's original."""
    redundant: np.ndarray
    """int32 [L, G, R]: expert copied into each redundant slot."""
    orig_gpu: np.ndarray
    """int64 [P]: GPU holding the original of edge ``p``'s expert (same in every layer)."""
    copy_gpu: np.ndarray
    """int64 [P]: GPU holding the copy."""

    @property
    def edge_expert(self) -> np.ndarray:
        """int32 [L, P]: expert carried by each edge."""
        return self.redundant.reshape(self.redundant.shape[0], -1)


def lplb_placement(
    weight: np.ndarray, r2o: np.ndarray, redundant_slots: int, nodes: int, policy: str = "global"
) -> LplbPlacement:
    """EPLB placement without replication, then copies of each GPU's heaviest experts along ``r2o``.

    weight [L, E] loads; r2o [G, D]; ``redundant_slots`` a multiple of D, at most E / G.
    """
    num_layers, num_experts = weight.shape
    g, d = r2o.shape
    per_gpu = num_experts // g
    if redundant_slots % d != 0 or redundant_slots > per_gpu:
        raise ValueError(
            f"planner.redundant_slots={redundant_slots} must be a multiple of the topology's {d} copies per "
            f"GPU and at most E/G={per_gpu}"
        )
    phy2log, _, _ = rebalance_experts(weight, num_experts, num_experts, nodes, g, policy)  # type: ignore[arg-type]
    local = phy2log.reshape(num_layers, g, per_gpu)  # [L, G, E/G]
    order = np.argsort(-np.take_along_axis(weight[:, None, :], local, -1), axis=-1, kind="stable")
    hot = np.take_along_axis(local, order, -1)  # [L, G, E/G], heaviest first
    home = np.empty((num_layers, num_experts), dtype=np.int32)
    np.put_along_axis(home, phy2log, np.broadcast_to(np.arange(num_experts) // per_gpu, phy2log.shape), -1)
    # slot k = c * D + j of GPU i copies position k of GPU r2o[i, j].
    k = np.arange(redundant_slots)
    src = r2o[:, k % d]  # [G, R]
    redundant = hot[:, src, k[None, :]].astype(np.int32)  # [L, G, R]
    copy_gpu = np.repeat(np.arange(g), redundant_slots)
    return LplbPlacement(home=home, redundant=redundant, orig_gpu=src.ravel(), copy_gpu=copy_gpu)


def _incidence(orig_gpu: np.ndarray, copy_gpu: np.ndarray, num_gpus: int) -> np.ndarray:
    """B [G, P]: +1 at the copy, -1 at the original (moving flow f_p changes loads by B[:, p] * f_p)."""
    p = np.arange(len(orig_gpu))
    b = np.zeros((num_gpus, len(orig_gpu)))
    b[copy_gpu, p] += 1.0
    b[orig_gpu, p] -= 1.0
    return b


def max_load(base: np.ndarray, flow: np.ndarray, orig_gpu: np.ndarray, copy_gpu: np.ndarray) -> np.ndarray:
    """Max GPU load after moving ``flow`` along the edges. base [X, G], flow [X, P] -> [X]."""
    return (base + flow @ _incidence(orig_gpu, copy_gpu, base.shape[-1]).T).max(-1)


def exact_split(
    base: np.ndarray, cap: np.ndarray, orig_gpu: np.ndarray, copy_gpu: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Solve every split LP exactly with HiGHS (one block-diagonal LP).

    base [X, G] tokens of the experts homed on each GPU; cap [X, P] tokens of each edge's expert;
    orig_gpu / copy_gpu [P]. Returns flow float64 [X, P] (tokens moved to the copy) and t [X] (the
    optimal max load).
    """
    x_count, g = base.shape
    p = cap.shape[1]
    nvar = p + 1  # f_0..f_{P-1}, t per problem
    # Column p of problem x: +1 in row x*G + copy, -1 in row x*G + orig; column t: -1 in all G rows.
    rows_f = np.stack([copy_gpu, orig_gpu], axis=1)  # [P, 2]
    rows = np.concatenate([rows_f.ravel(), np.arange(g)])  # one problem's entries, column-major
    vals = np.concatenate([np.tile([1.0, -1.0], p), -np.ones(g)])
    counts = np.concatenate([np.full(p, 2), [g]])
    offset = (np.arange(x_count) * g)[:, None]
    lp = highspy.HighsLp()
    lp.num_col_ = x_count * nvar
    lp.num_row_ = x_count * g
    lp.col_cost_ = np.tile(np.r_[np.zeros(p), 1.0], x_count)
    lp.col_lower_ = np.zeros(x_count * nvar)
    lp.col_upper_ = np.concatenate([cap, np.full((x_count, 1), highspy.kHighsInf)], axis=1).ravel()
    lp.row_lower_ = np.full(x_count * g, -highspy.kHighsInf)
    lp.row_upper_ = -np.asarray(base, dtype=np.float64).ravel()
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.r_[0, np.cumsum(np.tile(counts, x_count))].astype(np.int32)
    lp.a_matrix_.index_ = (rows[None, :] + offset).ravel().astype(np.int32)
    lp.a_matrix_.value_ = np.tile(vals, x_count)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(lp)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        raise RuntimeError(
            f"HiGHS did not solve the LPLB split LP: {h.modelStatusToString(h.getModelStatus())}"
        )
    sol = np.asarray(h.getSolution().col_value).reshape(x_count, nvar)
    return np.clip(sol[:, :p], 0.0, cap), sol[:, p]


Blocks = tuple[np.ndarray, ...]


@dataclass(frozen=True)
class _Newton:
    """One interior-point iteration's linear system (blocks ``[f, s, t, w]``; ``X`` batched problems)."""

    z: Blocks
    """dual slacks per block, [X, n_block]."""
    d: Blocks
    """``D = X Z^-1`` per block."""
    rd: Blocks
    """dual residuals per block."""
    rp1: np.ndarray
    """[X, P] primal residual of ``f + s = cap``."""
    rp2: np.ndarray
    """[X, G] primal residual of ``B f - t + w = -base``."""
    schur: np.ndarray
    """[X, G, G] Schur complement of the normal equations."""
    b_mat: np.ndarray
    """[G, P] edge incidence."""

    def direction(self, rc: Blocks) -> tuple[Blocks, Blocks, tuple[np.ndarray, np.ndarray]]:
        """Newton direction for complementarity residual ``rc`` (per block) -> (dx, dz, dy)."""
        b_mat = self.b_mat
        df_, ds_ = self.d[0], self.d[1]
        vf, vs, vt, vw = (-r / z + d * q for r, z, d, q in zip(rc, self.z, self.d, self.rd))
        r1 = self.rp1 + vf + vs
        r2 = self.rp2 + vf @ b_mat.T - vt + vw
        dy2 = np.linalg.solve(self.schur, (r2 - (df_ / (df_ + ds_) * r1) @ b_mat.T)[..., None])[..., 0]
        dy1 = (r1 - df_ * (dy2 @ b_mat)) / (df_ + ds_)
        at = (dy1 + dy2 @ b_mat, dy1, -dy2.sum(-1, keepdims=True), dy2)  # A^T dy
        dx = tuple(-v + d * a for v, d, a in zip((vf, vs, vt, vw), self.d, at))
        dz = tuple(q - a for q, a in zip(self.rd, at))
        return dx, dz, (dy1, dy2)


def _step(x: Blocks, dx: Blocks) -> np.ndarray:
    """Largest step in [0, 1] keeping every block of ``x + step * dx >= 0`` -> [X, 1]."""
    ratio = [np.where(d < 0, -v / np.where(d < 0, d, -1.0), np.inf).min(-1) for v, d in zip(x, dx)]
    return np.minimum(1.0, np.min(ratio, axis=0))[:, None]


def ipm_split(
    base: np.ndarray, cap: np.ndarray, orig_gpu: np.ndarray, copy_gpu: np.ndarray, iterations: int
) -> np.ndarray:
    """LPLB-style truncated interior-point solve of every split LP (batched over problems).

    Standard form with ``x = [f, s, t, w] >= 0``: ``f + s = cap`` and ``B f - t + w = -base``, objective
    ``t``. A Mehrotra predictor-corrector with the normal equations reduced to a G x G Schur complement,
    stopped after ``iterations`` steps; the iterate's ``f`` clipped to ``[0, cap]`` is returned (always a
    feasible split, possibly suboptimal). base [X, G], cap [X, P] -> flow float64 [X, P].
    """
    b_mat = _incidence(orig_gpu, copy_gpu, base.shape[-1])  # [G, P]
    scale = np.maximum(np.asarray(base, dtype=np.float64).max(-1, keepdims=True), 1.0)
    u = cap / scale
    bb = base / scale
    n = 2 * u.shape[1] + 1 + bb.shape[1]
    f = np.maximum(u / 2, 1e-2)
    s = np.maximum(u / 2, 1e-2)
    t = (bb + f @ b_mat.T).max(-1, keepdims=True) + 1.0
    w = np.maximum(t - bb - f @ b_mat.T, 1.0)
    zf, zs, zt, zw = np.ones_like(f), np.ones_like(s), np.ones_like(t), np.ones_like(w)
    y1, y2 = np.zeros_like(u), np.zeros_like(bb)

    for _ in range(iterations):
        rp1 = u - f - s
        rp2 = -bb - f @ b_mat.T + t - w
        rd = (-(y1 + y2 @ b_mat) - zf, -y1 - zs, 1.0 + y2.sum(-1, keepdims=True) - zt, -y2 - zw)
        xs, zs_ = (f, s, t, w), (zf, zs, zt, zw)
        dd = tuple(a / b for a, b in zip(xs, zs_))  # D = X Z^-1, per block
        df_, ds_, dt_, dw_ = dd
        h = df_ * ds_ / (df_ + ds_)
        schur = np.einsum("gp,xp,hp->xgh", b_mat, h, b_mat) + dt_[..., None]
        schur[:, np.arange(bb.shape[1]), np.arange(bb.shape[1])] += dw_

        mu = sum((a * b).sum(-1) for a, b in zip(xs, zs_))[:, None] / n
        newton = _Newton(zs_, dd, rd, rp1, rp2, schur, b_mat)
        dx_aff, dz_aff, _ = newton.direction(tuple(-a * b for a, b in zip(xs, zs_)))
        ap, ad = _step(xs, dx_aff), _step(zs_, dz_aff)
        mu_aff = (
            sum(
                ((a + ap * da) * (b + ad * db)).sum(-1, keepdims=True)
                for a, da, b, db in zip(xs, dx_aff, zs_, dz_aff)
            )
            / n
        )
        sigma = (mu_aff / mu) ** 3
        rc = tuple(sigma * mu - a * b - da * db for a, b, da, db in zip(xs, zs_, dx_aff, dz_aff))
        dx, dz, (dy1, dy2) = newton.direction(rc)
        ap, ad = 0.995 * _step(xs, dx), 0.995 * _step(zs_, dz)
        f, s, t, w = (a + ap * da for a, da in zip(xs, dx))
        zf, zs, zt, zw = (b + ad * db for b, db in zip(zs_, dz))
        y1, y2 = y1 + ad * dy1, y2 + ad * dy2
    return np.clip(f * scale, 0.0, cap)


@dataclass(frozen=True)
class LplbPlanner:
    """LPLB+ as a :class:`~relibra.planners.protocols.Planner`.

    ``topology`` ring, cube, hypercube, torus or auto (:func:`auto_topology`); ``redundant_slots`` (R) a
    multiple of the topology's copies per GPU; ``solver`` highs (exact) or ipm (``ipm_iterations``
    interior-point steps, gap to the exact LP reported); ``load_mode`` oracle or history (moving average
    of ``history_window`` batches) for the placement and the choice of copies.
    """

    name: str = "lplb"
    topology: Topology = "auto"
    redundant_slots: int = 2
    replica_slots: int = 0
    solver: Literal["highs", "ipm"] = "highs"
    ipm_iterations: int = 4
    load_mode: Literal["oracle", "history"] = "oracle"
    history_window: int = 10
    policy: Literal["hierarchical", "global"] = "global"

    def __post_init__(self) -> None:
        if self.topology not in (*TOPOLOGIES, "auto"):
            raise ValueError(f"planner.topology={self.topology!r}; expected one of {TOPOLOGIES}")
        if self.replica_slots != 0:
            raise ValueError(f"planner.replica_slots={self.replica_slots}: LPLB has no replica buffer; use 0")
        if self.solver not in ("highs", "ipm"):
            raise ValueError(f"planner.solver={self.solver!r}; expected highs or ipm")
        if self.ipm_iterations < 1:
            raise ValueError(f"planner.ipm_iterations={self.ipm_iterations}; need >= 1")
        if self.load_mode not in ("oracle", "history"):
            raise ValueError(f"planner.load_mode={self.load_mode!r}; expected oracle or history")

    replicas_in_home_node = False
    """Copies follow the topology's edges, which may cross nodes (torus, ring)."""

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    @property
    def history_batches(self) -> int:
        """Batches of past loads it reads: ``history_window`` in ``load_mode=history``, else none."""
        return self.history_window if self.load_mode == "history" else 0

    def cluster_problems(self, num_experts: int, cluster: ClusterSpec) -> list[str]:
        """What :meth:`plan` would refuse on this EP group: a topology the group cannot hold, or more
        redundant slots than a GPU has experts to copy (``redundant_slots`` a multiple of the topology's
        copies per GPU, at most ``E / G``: slot ``k`` copies a GPU's ``k``-th heaviest expert)."""
        try:
            r2o = redundant_to_original(self.topology, cluster.num_domains, cluster.domain_gpus)
        except ValueError as err:
            return [f"planner.topology={self.topology}: {err} (cluster.nodes, cluster.gpus_per_node)"]
        per_gpu = num_experts // cluster.num_gpus
        copies = r2o.shape[1]
        topology = (
            auto_topology(cluster.num_domains, cluster.domain_gpus)
            if self.topology == "auto"
            else self.topology
        )
        if self.redundant_slots % copies != 0 or self.redundant_slots > per_gpu:
            return [
                f"planner.redundant_slots={self.redundant_slots} must be a multiple of the "
                f"{topology} topology's {copies} copies per GPU and at most model.num_experts / G = "
                f"{num_experts} / {cluster.num_gpus} = {per_gpu} (each slot copies one of a GPU's experts)"
            ]
        return []

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with home [L, E], redundant [L, G, R], assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        mb, num_layers, g, num_experts = ctx.load.shape
        problems = self.cluster_problems(num_experts, ctx.cluster)
        if problems:
            raise ValueError("; ".join(problems))
        if self.load_mode == "oracle":
            weight = np.asarray(ctx.load, dtype=np.float64).sum(axis=(0, 2))
        else:
            weight = history_weight(ctx.history, self.history_window, (num_layers, num_experts))
        r2o = redundant_to_original(self.topology, ctx.cluster.num_domains, ctx.cluster.domain_gpus)
        placement = lplb_placement(weight, r2o, self.redundant_slots, ctx.cluster.num_domains, self.policy)

        assign = home_assign(ctx.load, placement.home, g).astype(np.int64)  # [Mb, L, E, G]
        total = assign.sum(-1)  # [Mb, L, E]
        base = assign.sum(-2).reshape(mb * num_layers, g).astype(np.float64)  # [X, G]
        edge_expert = placement.edge_expert  # [L, P]
        cap = np.take_along_axis(total, np.broadcast_to(edge_expert, (mb, *edge_expert.shape)), -1)
        cap = cap.reshape(mb * num_layers, -1).astype(np.float64)  # [X, P]
        if self.solver == "highs":
            flow, _ = exact_split(base, cap, placement.orig_gpu, placement.copy_gpu)
        else:
            flow = ipm_split(base, cap, placement.orig_gpu, placement.copy_gpu, self.ipm_iterations)
        moved = np.clip(np.rint(flow), 0, cap).astype(np.int64).reshape(mb, num_layers, -1)  # [Mb, L, P]
        m_idx, l_idx = np.indices((mb, num_layers))
        e_idx = np.broadcast_to(edge_expert, moved.shape)
        np.subtract.at(assign, (m_idx[..., None], l_idx[..., None], e_idx, placement.orig_gpu), moved)
        np.add.at(assign, (m_idx[..., None], l_idx[..., None], e_idx, placement.copy_gpu), moved)
        plan_time = time.perf_counter() - t0

        stats = {
            "redundant_experts_per_gpu": float(num_layers * self.redundant_slots),
            "redundant_bytes_per_gpu": float(
                num_layers * self.redundant_slots * ctx.cost.expert_weight_bytes()
            ),
            "lp_problems": float(mb * num_layers),
        }
        if self.solver == "ipm":
            _, t_exact = exact_split(base, cap, placement.orig_gpu, placement.copy_gpu)
            t_ipm = max_load(base, flow, placement.orig_gpu, placement.copy_gpu)
            gap = (t_ipm - t_exact) / np.maximum(t_exact, 1.0)
            stats["lp_gap_mean"] = float(gap.mean())
            stats["lp_gap_max"] = float(gap.max())
        plan = BatchPlan(
            home=placement.home,
            assign=assign.astype(np.int32),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            redundant=placement.redundant,
            stats=stats,
        )
        # NOTE: LPLB re-plans from scratch; among the equivalent relabellings keep experts where they are.
        t1 = time.perf_counter()
        plan = relabel_for(plan, ctx)
        return replace(plan, plan_time_s=plan_time + time.perf_counter() - t1)
