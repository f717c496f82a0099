"""ReLibra's inter-batch expert reordering: swap-based simulated annealing over placements.

Once per batch and per MoE layer, choose the home GPU of every expert (``E / G`` experts per GPU) so that
the batch's MoE time under the cost model is small (paper, section "inter-batch reordering"):

1. **Objective.** The cost model's ``T_MoE = max_g T_comp(g) + max_g T_comm(g)`` with every expert computed
   at home, using the linearised coefficients of :meth:`CostModel.linear` for compute (seconds per token plus
   a fixed cost per non-empty expert) and the exact rail-optimized link routing of
   :meth:`CostModel.link_bytes` for communication (``cluster.dispatcher=alltoall``). With
   ``dispatcher=deepep`` the communication term is the cost model's DeepEP estimate
   (:func:`relibra.fabric.deepep_link_tokens_estimate`): the search keeps, per (micro-batch, source), the
   probability that a token misses each GPU and each node, which a swap scales by one factor per source
   (O(Mb * G) per swap, as for alltoall). ``objective="microbatch"`` (the default) sums ``T_MoE``
   over the batch's ``Mb`` micro-batches, which is what the simulator charges; ``objective="aggregate"``
   evaluates one ``T_MoE`` on the batch's summed loads. The paper's O(G)-per-swap update is the aggregate
   form; the per-micro-batch form costs O(Mb * G) per swap.
2. **Smoothing.** ``LSE_beta(z) = (1 / beta) * log(sum_k exp(beta * z_k))`` replaces each max over GPUs
   during the search, so a swap that relieves a non-maximal GPU still lowers the objective; ``beta`` grows
   geometrically toward the hard max. The best placement is kept by the TRUE (hard-max) objective.
3. **Annealing.** Start from LPT (:func:`lpt_placement`); propose swaps of two experts on different GPUs,
   preferring different nodes (intra-node imbalance is the replicator's job); update the per-GPU compute
   and per-GPU link-class loads incrementally (a swap of ``a`` on ``p`` with ``b`` on ``q`` changes the
   traffic of every source towards ``p`` and ``q``: O(G) entries per micro-batch, never a recomputation);
   accept by the Metropolis rule on the smoothed objective. Several seeds; the best wins.
4. **Migration awareness** (beyond the paper): ``migration_weight > 0`` charges each GPU for the experts it
   receives from the previous batch's placement (weights, gradients and optimizer state; NVLink within a
   node, the rail NIC across nodes; the busiest GPU bounds the transfer), so a change must pay for itself.
5. **Node-level compute** (``compute_level="node"``, beyond the paper's objective): the compute term of each
   micro-batch becomes the max over nodes of ``node compute / gpus_per_node``, the per-GPU compute after
   perfect intra-node balancing. The assumption follows the paper's own division of labour: reordering
   should "prefer different nodes, since replication fixes intra-node imbalance later"; so when intra-node
   replication follows (the ``relibra`` planner), effort spent on intra-node balance is wasted, and
   node-level imbalance, which replication cannot fix, is what the placement must remove. The
   incremental state stays per GPU; the node sums are formed in the O(G) evaluation. The communication
   term is unchanged. Keep ``gpu`` when nothing replicates afterwards (``relibra_reorder_only``).

All times inside the search are normalised by the mean per-GPU compute time of a micro-batch, so ``beta``
and the temperatures are dimensionless. The hot loop is compiled with numba.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
from numba import njit

from relibra.cluster import ClusterSpec
from relibra.cost import CostModel
from relibra.migration import DEFAULT_BYTES_PER_PARAM
from relibra.planner import BatchContext, Reordering, static_placement
from relibra.planners.links import NUM_LINKS, comm_gpu, deepep_routes, link_routes
from relibra.planners.locality import locality_round

__all__ = [
    "AnnealConfig",
    "AnnealingReorderer",
    "LayerProblem",
    "anneal_layer",
    "deepep_routes",
    "full_state",
    "layer_problem",
    "link_routes",
    "lpt_placement",
    "main_iterations",
    "placement_objective",
    "solve_layer",
]


@dataclass(frozen=True)
class AnnealConfig:
    """Parameters of :class:`AnnealingReorderer`. These defaults are the only ones: the Hydra node
    ``planner/reorder/anneal`` is generated from them (:mod:`experiments.planner_nodes`)."""

    iterations: int | None = None
    """Swap proposals per seed and layer on ``objective`` after the warm-up; None: the same work for every
    layer shape, ``work_per_layer / (rows * G)`` proposals (rows: ``Mb``, or 1 for the aggregate form),
    clipped to ``[min_iterations, max_iterations]`` (so small problems get more proposals)."""
    work_per_layer: int = 512_000
    """Incremental-update work (rows x GPUs per proposal, summed) per seed and layer when ``iterations`` is
    None: 500 proposals for 16 micro-batches on 64 GPUs."""
    min_iterations: int = 500
    max_iterations: int = 20_000
    aggregate_warmup: int = 2000
    """Swap proposals on the aggregate objective first (about ``Mb`` times cheaper each than per micro-batch);
    the main phase then starts from the better of the warm-up's best and the start, at a lower temperature."""
    warm_temperature_start: float = 0.002
    """Initial temperature of the main phase after a warm-up (lower: refine rather than restart)."""
    seeds: tuple[int, ...] = (0, 1)
    """Independent annealing runs per layer; the best placement by the true objective wins."""
    objective: str = "microbatch"
    """``microbatch``: sum of ``T_MoE`` over micro-batches; ``aggregate``: ``T_MoE`` of the summed loads."""
    beta_start: float = 8.0
    """Initial LSE sharpness, in units of 1 / (mean per-GPU compute time of a micro-batch)."""
    beta_end: float = 2000.0
    """Final LSE sharpness (``log(G) / beta_end`` is the largest remaining smoothing error)."""
    beta_stages: int = 24
    """Number of geometric beta steps (the smoothed current value is re-evaluated at each step)."""
    temperature_start: float = 0.02
    """Initial Metropolis temperature, relative to the LPT start's smoothed objective."""
    temperature_end: float = 1e-5
    """Final Metropolis temperature, relative to the LPT start's smoothed objective."""
    cross_node_prob: float = 0.85
    """Probability that a proposal swaps with an expert on another node (when there are several nodes)."""
    guided_prob: float = 0.5
    """Probability that the first expert of a proposal comes from a bottleneck GPU of a random micro-batch."""
    migration_weight: float = 0.0
    """Weight of the migration time (seconds per batch) added to the objective; 0 disables it."""
    locality: bool = False
    """Run the second round (sample re-assignment for data locality, :mod:`relibra.planners.locality`)."""
    locality_tolerance: float = 0.05
    """Balance tolerance of the locality round, in (0, 1]: it may move samples only while every GPU of the
    micro-batch keeps at most ``(1 + tolerance)`` times the mean tokens and the mean causal attention pairs
    (or the busiest GPU's before, if that is more)."""
    locality_iterations: int = 10
    """Move / swap proposals of the locality round per sample."""
    workers: int = 1
    """Processes for the per-layer problems (layers are split over workers; each runs every seed)."""
    comm_weight: float = 1.0
    """Weight of the communication term in the objective (1: the cost model's ``T_MoE``). ``0`` turns the
    search into pure compute balancing, the load-balancing view of the paper's skewness figures: it trades
    ``T_MoE`` for balance wherever the all-to-all dominates (docs/benchmarks.md, "Balance-first")."""
    compute_level: str = "gpu"
    """Compute term of the objective. ``gpu``: the per-GPU max (what the placement alone runs). ``node``: the
    per-node max of ``node compute / gpus_per_node``, the per-GPU compute after perfect intra-node balancing
    by replicas; for a reordering that intra-node replication follows (see the module docstring, 5.)."""

    def __post_init__(self) -> None:
        # NOTE: Hydra hands a list (or one int); a tuple keeps the config hashable and its repr stable.
        seeds = (self.seeds,) if isinstance(self.seeds, int) else self.seeds
        object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        if self.objective not in ("microbatch", "aggregate"):
            raise ValueError(f"objective={self.objective!r}; expected 'microbatch' or 'aggregate'")
        if (self.iterations is not None and self.iterations < 0) or self.aggregate_warmup < 0:
            raise ValueError(
                f"iterations={self.iterations}, aggregate_warmup={self.aggregate_warmup}; expected >= 0"
            )
        if not (0 <= self.min_iterations <= self.max_iterations) or self.work_per_layer < 0:
            raise ValueError(
                f"min_iterations={self.min_iterations}, max_iterations={self.max_iterations}, work_per_layer="
                f"{self.work_per_layer}; need 0 <= min <= max and work >= 0"
            )
        if not (self.temperature_end <= self.warm_temperature_start):
            raise ValueError(
                f"warm_temperature_start={self.warm_temperature_start}; expected >= temperature_end="
                f"{self.temperature_end}"
            )
        if len(self.seeds) == 0:
            raise ValueError("seeds is empty; give at least one seed, e.g. seeds=[0]")
        if not (0 < self.beta_start <= self.beta_end):
            raise ValueError(f"beta_start={self.beta_start}, beta_end={self.beta_end}; need 0 < start <= end")
        if self.beta_stages < 1:
            raise ValueError(f"beta_stages={self.beta_stages}; expected >= 1")
        if not (0 < self.temperature_end <= self.temperature_start):
            raise ValueError(
                f"temperature_start={self.temperature_start}, temperature_end={self.temperature_end}; "
                "need 0 < end <= start"
            )
        for name in ("cross_node_prob", "guided_prob"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v}; expected a probability in [0, 1]")
        if self.migration_weight < 0:
            raise ValueError(f"migration_weight={self.migration_weight}; expected >= 0")
        if not 0 < self.locality_tolerance <= 1:
            raise ValueError(f"locality_tolerance={self.locality_tolerance}; expected a value in (0, 1]")
        if self.locality_iterations < 0:
            raise ValueError(f"locality_iterations={self.locality_iterations}; expected >= 0")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers}; expected >= 1")
        if self.compute_level not in ("gpu", "node"):
            raise ValueError(f"compute_level={self.compute_level!r}; expected 'gpu' or 'node'")
        if not (math.isfinite(self.comm_weight) and self.comm_weight >= 0):
            raise ValueError(f"comm_weight={self.comm_weight}; expected a finite number >= 0")


# ----------------------------------------------------------------------------------------------- LPT
def lpt_placement(load_e: np.ndarray, num_gpus: int) -> np.ndarray:
    """Greedy LPT placement: heaviest expert first onto the least-loaded GPU with a free home slot.

    Args:
        load_e: [L, E] or [E] per-expert load (tokens or seconds).
        num_gpus: ``G``; must divide ``E``.
    Returns:
        int32 home of the same shape: each GPU is home to exactly ``E / G`` experts per layer. Ties go to the
        lowest GPU id (deterministic).
    """
    load = np.asarray(load_e, dtype=np.float64)
    squeeze = load.ndim == 1
    if squeeze:
        load = load[None]
    if load.ndim != 2:
        raise ValueError(f"load_e has shape {np.shape(load_e)}; expected [L, E] or [E]")
    num_layers, num_experts = load.shape
    if num_gpus < 1 or num_experts % num_gpus != 0:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1 and divide the number of experts E={num_experts}")
    per_gpu = num_experts // num_gpus
    order = np.argsort(-load, axis=1, kind="stable")  # [L, E]
    gpu_load = np.zeros((num_layers, num_gpus))
    gpu_count = np.zeros((num_layers, num_gpus), dtype=np.int64)
    home = np.empty((num_layers, num_experts), dtype=np.int32)
    rows = np.arange(num_layers)
    for i in range(num_experts):
        e = order[:, i]
        g = np.argmin(np.where(gpu_count < per_gpu, gpu_load, np.inf), axis=1)
        home[rows, e] = g
        gpu_load[rows, g] += load[rows, e]
        gpu_count[rows, g] += 1
    return home[0] if squeeze else home


# -------------------------------------------------------------------------------- one layer's problem
@dataclass(frozen=True)
class LayerProblem:
    """One layer's reordering problem in normalised units (times divided by ``scale`` seconds)."""

    x: np.ndarray
    """float64 [Mb, E, G]: tokens of expert ``e`` held by source GPU ``j`` (transposed ``x[m, j, e]``)."""
    w: np.ndarray
    """float64 [Mb, E]: normalised compute time of expert ``e`` (per-token + fixed per non-empty expert)."""
    coef: np.ndarray
    """float64 [3]: normalised NVLink and NIC time per token per phase, and the normalised fixed latency."""
    mig: np.ndarray
    """float64 [E, G]: weighted normalised migration time if expert ``e`` is homed on ``g`` (0: no charge)."""
    scale: float
    """Seconds per normalised unit (the mean per-GPU compute time of a micro-batch)."""
    compute_group: int = 1
    """GPUs pooled in the compute term: 1 (per-GPU max) or ``gpus_per_node`` (per-node mean, then max)."""
    lq: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    """float64 [Mb, E, G(j)]: ``log(1 - x[m, j, e] / T_j)`` for the ``deepep`` dispatcher's estimate
    (:func:`relibra.fabric.deepep_link_tokens_estimate`); empty for ``alltoall``."""
    tok: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """float64 [Mb, G(j)]: tokens held by each source (``deepep``; empty for ``alltoall``)."""

    @property
    def deepep(self) -> bool:
        return self.lq.size > 0


def layer_problem(
    load_l: np.ndarray,
    cost: CostModel,
    *,
    prev_home: np.ndarray | None = None,
    migration_weight: float = 0.0,
    compute_level: str = "gpu",
    comm_weight: float = 1.0,
) -> LayerProblem:
    """Normalise one layer's loads ``load_l`` [Mb, G, E] (one row per micro-batch) into a problem.

    ``prev_home`` [E] (the previous placement) and ``migration_weight`` define the migration charge;
    ``compute_level`` (``gpu`` or ``node``, see :class:`AnnealConfig`) the compute term, ``comm_weight``
    the weight of the communication term (its latency constant included).
    """
    load_l = np.asarray(load_l)
    if load_l.ndim != 3:
        raise ValueError(f"load_l has shape {load_l.shape}; expected [Mb, G, E]")
    if compute_level not in ("gpu", "node"):
        raise ValueError(f"compute_level={compute_level!r}; expected 'gpu' or 'node'")
    mb, g, e = load_l.shape
    lin = cost.linear()
    tokens = load_l.sum(axis=1, dtype=np.float64)  # [Mb, E]
    w_s = lin.compute_s_per_token * tokens + lin.compute_s_per_expert * (tokens > 0)
    scale = float(w_s.sum() / (mb * g)) if w_s.sum() > 0 else 1.0
    lat = 4.0 * cost.cluster.hardware.alltoall_latency_s if g > 1 else 0.0
    if not (math.isfinite(comm_weight) and comm_weight >= 0):
        raise ValueError(f"comm_weight={comm_weight}; expected a finite number >= 0")
    coef = comm_weight * np.array([lin.nvlink_s_per_token / 4.0, lin.rdma_s_per_token / 4.0, lat]) / scale
    mig = np.zeros((e, g))
    if prev_home is not None and migration_weight > 0:
        prev = np.asarray(prev_home, dtype=np.int64)
        if prev.shape != (e,):
            raise ValueError(f"prev_home has shape {prev.shape}; expected [E]=({e},)")
        gpn = cost.cluster.gpus_per_node
        nbytes = cost.model.expert_params * DEFAULT_BYTES_PER_PARAM
        token_bytes = cost.model.hidden * 2.0
        s_per_byte_nvl = lin.nvlink_s_per_token / (4.0 * token_bytes)
        s_per_byte_nic = lin.rdma_s_per_token / (4.0 * token_bytes)
        gpus = np.arange(g)
        same_node = (prev[:, None] // gpn) == (gpus[None, :] // gpn)
        mig = np.where(same_node, nbytes * s_per_byte_nvl, nbytes * s_per_byte_nic)
        mig[prev[:, None] == gpus[None, :]] = 0.0
        mig = migration_weight * mig / scale
    x = np.ascontiguousarray(load_l.transpose(0, 2, 1), dtype=np.float64)
    group = cost.cluster.gpus_per_node if compute_level == "node" else 1
    lq, tok = np.zeros((0, 0, 0)), np.zeros((0, 0))
    if cost.dispatcher == "deepep":
        tok = load_l.sum(axis=2, dtype=np.float64) / cost.model.top_k  # [Mb, G]
        q = np.divide(x, tok[:, None, :], out=np.zeros_like(x), where=tok[:, None, :] > 0)
        lq = np.ascontiguousarray(np.log1p(-np.minimum(q, 1.0 - 1e-12)))
    return LayerProblem(
        x=x,
        w=w_s / scale,
        coef=coef,
        mig=np.ascontiguousarray(mig),
        scale=scale,
        compute_group=group,
        lq=lq,
        tok=np.ascontiguousarray(tok),
    )


# ------------------------------------------------------------------------------------ numba kernels
@njit(cache=True)
def full_state(
    home: np.ndarray, x: np.ndarray, w: np.ndarray, idx: np.ndarray, cnt: np.ndarray, mig: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-GPU state from scratch: comp [Mb, G], link [Mb, 8 * G] (tokens), migration [G]."""
    mb, e_total, g_total = x.shape
    comp = np.zeros((mb, g_total))
    link = np.zeros((mb, NUM_LINKS * g_total))
    migr = np.zeros(g_total)
    for e in range(e_total):
        g = home[e]
        migr[g] += mig[e, g]
        for m in range(mb):
            comp[m, g] += w[m, e]
            for j in range(g_total):
                v = x[m, e, j]
                if v != 0.0:
                    for k in range(cnt[j, g]):
                        link[m, idx[j, g, k]] += v
    return comp, link, migr


@njit(cache=True)
def full_state_deepep(
    home: np.ndarray,
    lq: np.ndarray,
    tok: np.ndarray,
    w: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    nodes: int,
    mig: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``deepep`` state from scratch: comp [Mb, G], link [Mb, 8 * G], migration [G], and the estimate's miss
    probabilities [Mb, G(j), G(g)] and [Mb, G(j), N] (a token of j misses GPU g / node n; it reaches it
    with ``tok[j] * (1 - miss)`` tokens)."""
    gidx, gcnt, nidx, ncnt = droutes
    mb, e_total, g_total = lq.shape
    gpn = g_total // nodes
    comp = np.zeros((mb, g_total))
    link = np.zeros((mb, NUM_LINKS * g_total))
    migr = np.zeros(g_total)
    lg = np.zeros((mb, g_total, g_total))
    ln = np.zeros((mb, g_total, nodes))
    for e in range(e_total):
        g = home[e]
        migr[g] += mig[e, g]
        for m in range(mb):
            comp[m, g] += w[m, e]
            for j in range(g_total):
                lg[m, j, g] += lq[m, e, j]
                ln[m, j, g // gpn] += lq[m, e, j]
    for m in range(mb):
        for j in range(g_total):
            t = tok[m, j]
            for g in range(g_total):
                v = -t * math.expm1(lg[m, j, g])
                lg[m, j, g] = math.exp(lg[m, j, g])
                for k in range(gcnt[j, g]):
                    link[m, gidx[j, g, k]] += v
            for n in range(nodes):
                v = -t * math.expm1(ln[m, j, n])
                ln[m, j, n] = math.exp(ln[m, j, n])
                for k in range(ncnt[j, n]):
                    link[m, nidx[j, n, k]] += v
    return comp, link, migr, lg, ln


@njit(cache=True, inline="always")
def _move_deepep(
    m: int,
    j: int,
    col: int,
    f: float,
    miss: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    t: float,
    link: np.ndarray,
) -> None:
    """Scale the miss probability ``miss[m, j, col]`` by ``f`` and add its token change to the links."""
    old = miss[m, j, col]
    new = old * f
    miss[m, j, col] = new
    v = t * (old - new)
    for k in range(cnt[j, col]):
        link[m, idx[j, col, k]] += v


@njit(cache=True)
def _apply_swap_deepep(
    a: int,
    b: int,
    p: int,
    q: int,
    lq: np.ndarray,
    tok: np.ndarray,
    w: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    nodes: int,
    mig: np.ndarray,
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
    lg: np.ndarray,
    ln: np.ndarray,
) -> None:
    """:func:`_apply_swap` for the ``deepep`` estimate: O(Mb * G) updates of the miss probabilities ``lg``
    (per GPU) and ``ln`` (per node) and of their links."""
    gidx, gcnt, nidx, ncnt = droutes
    mb, _, g_total = lq.shape
    gpn = g_total // nodes
    np_, nq = p // gpn, q // gpn
    migr[p] += mig[b, p] - mig[a, p]
    migr[q] += mig[a, q] - mig[b, q]
    for m in range(mb):
        dw = w[m, b] - w[m, a]
        comp[m, p] += dw
        comp[m, q] -= dw
        for j in range(g_total):
            d = lq[m, b, j] - lq[m, a, j]
            if d != 0.0:
                t = tok[m, j]
                f = math.exp(d)  # one exp per (micro-batch, source): miss probabilities scale by f, 1 / f
                _move_deepep(m, j, p, f, lg, gidx, gcnt, t, link)
                _move_deepep(m, j, q, 1.0 / f, lg, gidx, gcnt, t, link)
                if np_ != nq:
                    _move_deepep(m, j, np_, f, ln, nidx, ncnt, t, link)
                    _move_deepep(m, j, nq, 1.0 / f, ln, nidx, ncnt, t, link)


@njit(cache=True, inline="always")
def _no_comm(coef: np.ndarray) -> bool:
    """Whether the communication term weighs nothing (``comm_weight=0``: every coefficient is 0)."""
    return coef[0] == 0.0 and coef[1] == 0.0 and coef[2] == 0.0


@njit(cache=True, inline="always")
def _comm_term(
    link_m: np.ndarray, coef: np.ndarray, beta: float, comm: np.ndarray
) -> tuple[float, int, float]:
    """One micro-batch's communication term: (max over GPUs, its GPU, the LSE sum ``sum_g exp(beta * (c_g -
    max))``) of the all-to-all times from the link loads ``link_m`` [8 * G]; ``comm`` [G] is scratch."""
    g_total = comm.shape[0]
    kmax = -1.0
    ka = 0
    for g in range(g_total):
        v = comm_gpu(link_m, g, g_total, coef)
        comm[g] = v
        if v > kmax:
            kmax = v
            ka = g
    sk = 0.0
    for g in range(g_total):
        u = beta * (comm[g] - kmax)
        if u > -40.0:
            sk += math.exp(u)
    return kmax, ka, sk


@njit(cache=True)
def _evaluate(
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
    coef: np.ndarray,
    beta: float,
    arg: np.ndarray,
    group: int,
) -> tuple[float, float]:
    """(true, smoothed) normalised objective; writes each micro-batch's bottleneck GPUs to ``arg`` [Mb, 2].

    The compute term is the max over groups of ``group`` consecutive GPUs of their mean compute (``group=1``:
    the per-GPU max; ``group=gpus_per_node``: the per-node mean); its bottleneck GPU is the busiest GPU of
    the bottleneck group. O(G) per micro-batch.
    """
    mb, g_total = comp.shape
    n_groups = g_total // group
    comm = np.empty(g_total)
    cgrp = np.empty(n_groups)
    true = 0.0
    smooth = 0.0
    no_comm = _no_comm(coef)
    for m in range(mb):
        cmax = -1.0
        ca = 0
        for n in range(n_groups):
            s = 0.0
            top = -1.0
            tg = n * group
            for g in range(n * group, (n + 1) * group):
                s += comp[m, g]
                if comp[m, g] > top:
                    top = comp[m, g]
                    tg = g
            s /= group
            cgrp[n] = s
            if s > cmax:
                cmax = s
                ca = tg
        sc = 0.0
        # NOTE: terms below exp(-40) cannot change a float64 sum that already holds 1.0.
        for n in range(n_groups):
            u = beta * (cgrp[n] - cmax)
            if u > -40.0:
                sc += math.exp(u)
        if no_comm:
            # NOTE: every GPU's term is exactly 0 (comm_weight=0), so the loops below would find GPU 0 the
            # bottleneck and sum G exact ones: the same values without reading the links.
            kmax, ka, sk = 0.0, 0, float(g_total)
        else:
            kmax, ka, sk = _comm_term(link[m], coef, beta, comm)
        true += cmax + kmax
        smooth += cmax + kmax + (math.log(sc) + math.log(sk)) / beta
        arg[m, 0] = ca
        arg[m, 1] = ka
    mmax = 0.0
    for g in range(g_total):
        if migr[g] > mmax:
            mmax = migr[g]
    return true + mmax, smooth + mmax


@njit(cache=True)
def _swap_compute(
    a: int, b: int, p: int, q: int, w: np.ndarray, mig: np.ndarray, comp: np.ndarray, migr: np.ndarray
) -> None:
    """The compute and migration part of :func:`_apply_swap`: O(Mb)."""
    migr[p] += mig[b, p] - mig[a, p]
    migr[q] += mig[a, q] - mig[b, q]
    for m in range(w.shape[0]):
        dw = w[m, b] - w[m, a]
        comp[m, p] += dw
        comp[m, q] -= dw


@njit(cache=True)
def _apply_swap(
    a: int,
    b: int,
    p: int,
    q: int,
    x: np.ndarray,
    w: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    mig: np.ndarray,
    comp: np.ndarray,
    link: np.ndarray,
    migr: np.ndarray,
) -> None:
    """Move expert ``a`` from GPU ``p`` to ``q`` and ``b`` from ``q`` to ``p``: O(Mb * G) state update."""
    mb, _, g_total = x.shape
    _swap_compute(a, b, p, q, w, mig, comp, migr)
    for m in range(mb):
        for j in range(g_total):
            d = x[m, b, j] - x[m, a, j]
            if d != 0.0:
                for k in range(cnt[j, p]):
                    link[m, idx[j, p, k]] += d
                for k in range(cnt[j, q]):
                    link[m, idx[j, q, k]] -= d


@njit(cache=True)
def _anneal_kernel(
    home0: np.ndarray,
    x: np.ndarray,
    w: np.ndarray,
    idx: np.ndarray,
    cnt: np.ndarray,
    mig: np.ndarray,
    coef: np.ndarray,
    gpus_per_node: int,
    iterations: int,
    rng: np.random.Generator,
    beta_start: float,
    beta_end: float,
    beta_stages: int,
    t_start: float,
    t_end: float,
    cross_node_prob: float,
    guided_prob: float,
    group: int,
    lq: np.ndarray,
    tok: np.ndarray,
    droutes: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, float, float, int]:
    """Anneal one layer from ``home0`` [E]. Returns (best home, best true objective, start true, accepted)."""
    mb, e_total, g_total = x.shape
    per_gpu = e_total // g_total
    nodes = g_total // gpus_per_node
    home = home0.copy()
    slots = np.empty((g_total, per_gpu), dtype=np.int64)
    pos = np.empty(e_total, dtype=np.int64)
    fill = np.zeros(g_total, dtype=np.int64)
    for e in range(e_total):
        g = home[e]
        slots[g, fill[g]] = e
        pos[e] = fill[g]
        fill[g] += 1
    deepep = lq.size > 0
    # NOTE: with comm_weight=0 the objective never reads the link loads (_evaluate), so an alltoall
    # search stops updating them: the same proposals, acceptances and placements, without the O(Mb * G)
    # link work per swap.
    skip_links = _no_comm(coef) and not deepep
    if deepep:
        comp, link, migr, lg, ln = full_state_deepep(home, lq, tok, w, droutes, nodes, mig)
    else:
        comp, link, migr = full_state(home, x, w, idx, cnt, mig)
        lg = np.zeros((mb, 0, 0))
        ln = np.zeros((mb, 0, 0))
    comp2 = comp.copy()
    link2 = link.copy()
    migr2 = migr.copy()
    arg = np.zeros((mb, 2), dtype=np.int64)
    arg_new = np.zeros((mb, 2), dtype=np.int64)
    beta = beta_start
    true0, cur = _evaluate(comp, link, migr, coef, beta, arg, group)
    best = true0
    best_home = home.copy()
    if g_total < 2 or iterations == 0:
        return best_home, best, true0, 0
    t_scale = max(cur, 1e-12)
    accepted = 0
    stage_len = max(1, iterations // beta_stages)
    for it in range(iterations):
        frac = it / iterations
        if it % stage_len == 0 and it > 0:
            beta = beta_start * (beta_end / beta_start) ** frac
            _, cur = _evaluate(comp, link, migr, coef, beta, arg, group)
        temp = t_scale * t_start * (t_end / t_start) ** frac
        # Step 1: the first expert, from a bottleneck GPU (guided) or uniformly.
        if rng.random() < guided_prob:
            p = arg[rng.integers(0, mb), rng.integers(0, 2)]
            a = slots[p, rng.integers(0, per_gpu)]
        else:
            a = rng.integers(0, e_total)
            p = home[a]
        # Step 2: the partner GPU, preferably on another node.
        if nodes > 1 and rng.random() < cross_node_prob:
            node_p = p // gpus_per_node
            nd = rng.integers(0, nodes - 1)
            if nd >= node_p:
                nd += 1
            q = nd * gpus_per_node + rng.integers(0, gpus_per_node)
        else:
            q = rng.integers(0, g_total - 1)
            if q >= p:
                q += 1
        b = slots[q, rng.integers(0, per_gpu)]
        # Step 3: incremental update of a scratch copy (cheaper than undoing a rejected swap), Metropolis
        # acceptance on the smoothed objective.
        comp2[:, :] = comp
        if not skip_links:
            link2[:, :] = link
        migr2[:] = migr
        if skip_links:
            _swap_compute(a, b, p, q, w, mig, comp2, migr2)
        elif deepep:
            # NOTE: the miss probabilities are O(Mb * G^2): updated in place and undone on rejection rather
            # than copied every proposal (the scratch copies carry the O(Mb * G) rest).
            _apply_swap_deepep(a, b, p, q, lq, tok, w, droutes, nodes, mig, comp2, link2, migr2, lg, ln)
        else:
            _apply_swap(a, b, p, q, x, w, idx, cnt, mig, comp2, link2, migr2)
        new_true, new = _evaluate(comp2, link2, migr2, coef, beta, arg_new, group)
        delta = new - cur
        if delta <= 0.0 or rng.random() < math.exp(-delta / temp):
            comp, comp2 = comp2, comp
            link, link2 = link2, link
            migr, migr2 = migr2, migr
            accepted += 1
            cur = new
            home[a] = q
            home[b] = p
            pa = pos[a]
            pb = pos[b]
            slots[q, pb] = a
            slots[p, pa] = b
            pos[a] = pb
            pos[b] = pa
            arg[:, :] = arg_new
            if new_true < best:
                best = new_true
                best_home[:] = home
        elif deepep:  # undo the in-place miss-probability update (a back to p, b back to q)
            _apply_swap_deepep(b, a, p, q, lq, tok, w, droutes, nodes, mig, comp2, link2, migr2, lg, ln)
    return best_home, best, true0, accepted


_NO_DROUTES = (
    np.zeros((0, 0, 4), dtype=np.int32),
    np.zeros((0, 0), dtype=np.int32),
    np.zeros((0, 0, 4), dtype=np.int32),
    np.zeros((0, 0), dtype=np.int32),
)


def _droutes(
    problem: LayerProblem, cluster: ClusterSpec
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`deepep_routes` for a ``deepep`` problem, empty arrays otherwise (the kernels' typing)."""
    return deepep_routes(cluster.nodes, cluster.gpus_per_node) if problem.deepep else _NO_DROUTES


def anneal_layer(
    problem: LayerProblem,
    home0: np.ndarray,
    cluster: ClusterSpec,
    config: AnnealConfig,
    seed: int,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, float, float]:
    """Anneal one layer from ``home0`` [E] with one seed.

    Returns (best home int32 [E], its true objective in seconds, the start's true objective in seconds).
    """
    idx, cnt = routes if routes is not None else link_routes(cluster.nodes, cluster.gpus_per_node)
    best_home, best, start, _ = _anneal_kernel(
        np.asarray(home0, dtype=np.int64),
        problem.x,
        problem.w,
        idx,
        cnt,
        problem.mig,
        problem.coef,
        cluster.gpus_per_node,
        main_iterations(config, problem.x.shape[0], problem.x.shape[2]),
        np.random.default_rng(seed),
        config.beta_start,
        config.beta_end,
        config.beta_stages,
        config.temperature_start,
        config.temperature_end,
        config.cross_node_prob,
        config.guided_prob,
        problem.compute_group,
        problem.lq,
        problem.tok,
        _droutes(problem, cluster),
    )
    return best_home.astype(np.int32), best * problem.scale, start * problem.scale


def placement_objective(
    problem: LayerProblem,
    home: np.ndarray,
    cluster: ClusterSpec,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> float:
    """True objective in seconds of placement ``home`` [E] (sum over the problem's micro-batches)."""
    idx, cnt = routes if routes is not None else link_routes(cluster.nodes, cluster.gpus_per_node)
    h = np.asarray(home, dtype=np.int64)
    if problem.deepep:
        comp, link, migr, _, _ = full_state_deepep(
            h, problem.lq, problem.tok, problem.w, _droutes(problem, cluster), cluster.nodes, problem.mig
        )
    else:
        comp, link, migr = full_state(h, problem.x, problem.w, idx, cnt, problem.mig)
    arg = np.zeros((comp.shape[0], 2), dtype=np.int64)
    true, _ = _evaluate(comp, link, migr, problem.coef, 1.0, arg, problem.compute_group)
    return float(true * problem.scale)


# ----------------------------------------------------------------------------------- the reorderer
@dataclass(frozen=True)
class _LayerTask:
    """Picklable work unit: a chunk of layers, all seeds."""

    layers: tuple[int, ...]
    loads: np.ndarray
    """[Mb', n, G, E] loads of the chunk's layers (Mb' = 1 for the aggregate objective)."""
    prev_home: np.ndarray | None
    """[n, E] or None."""
    start_home: np.ndarray
    """[n, E] LPT start placements."""
    seeds: tuple[int, ...]
    config: AnnealConfig = field(repr=False)
    cost: CostModel = field(repr=False)


def main_iterations(config: AnnealConfig, rows: int, num_gpus: int) -> int:
    """Swap proposals of the main phase for a layer with ``rows`` objective rows on ``num_gpus`` GPUs."""
    if config.iterations is not None:
        return config.iterations
    auto = config.work_per_layer // max(1, rows * num_gpus)
    return int(min(max(auto, config.min_iterations), config.max_iterations))


def solve_layer(
    load_l: np.ndarray,
    cost: CostModel,
    config: AnnealConfig,
    *,
    start: np.ndarray | None = None,
    prev_home: np.ndarray | None = None,
    layer: int = 0,
    seeds: tuple[int, ...] | None = None,
    routes: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, float, float]:
    """One layer, every seed, as :class:`AnnealingReorderer` runs it.

    Args:
        load_l: [Mb, G, E] loads whose summed ``T_MoE`` is the objective (one row for the aggregate form).
        start: [E] start placement (default: LPT on the experts' compute); prev_home: [E] or None.
        layer: mixes into each seed's stream; seeds: default ``config.seeds``.
    Returns:
        (best home int32 [E], its true objective in seconds, the LPT / given start's objective in seconds).
    """
    cfg = config
    routes = routes if routes is not None else link_routes(cost.cluster.nodes, cost.cluster.gpus_per_node)
    g = cost.cluster.num_gpus
    problem = layer_problem(
        load_l,
        cost,
        prev_home=prev_home,
        migration_weight=cfg.migration_weight,
        compute_level=cfg.compute_level,
        comm_weight=cfg.comm_weight,
    )
    if start is None:
        start = lpt_placement(problem.w.sum(axis=0), g)
    start_obj = placement_objective(problem, start, cost.cluster, routes)
    lpt_obj = start_obj
    if prev_home is not None and cfg.migration_weight > 0:
        # NOTE: staying put costs no migration; start from whichever is better by the true objective.
        prev_obj = placement_objective(problem, prev_home, cost.cluster, routes)
        if prev_obj < start_obj:
            start, start_obj = np.asarray(prev_home, dtype=np.int32), prev_obj
    warm = cfg.aggregate_warmup > 0
    main_cfg = cfg
    if warm:
        agg = layer_problem(
            np.asarray(load_l).sum(axis=0, keepdims=True, dtype=np.int64),
            cost,
            prev_home=prev_home,
            migration_weight=cfg.migration_weight,
            compute_level=cfg.compute_level,
            comm_weight=cfg.comm_weight,
        )
        agg_cfg = replace(cfg, iterations=cfg.aggregate_warmup)
        main_cfg = replace(cfg, temperature_start=cfg.warm_temperature_start)
    main_cfg = replace(main_cfg, iterations=main_iterations(cfg, problem.x.shape[0], g))
    best: tuple[np.ndarray, float] | None = None
    for s in seeds if seeds is not None else cfg.seeds:
        seed = int(np.random.SeedSequence([s, layer]).generate_state(1)[0] & 0x7FFFFFFF)
        first = start
        if warm:
            # Step 1: the cheap aggregate objective; Step 2: refine on the per-micro-batch objective.
            w_home, _, _ = anneal_layer(agg, start, cost.cluster, agg_cfg, seed + 1, routes)
            if placement_objective(problem, w_home, cost.cluster, routes) < start_obj:
                first = w_home
        home, obj, _ = anneal_layer(problem, first, cost.cluster, main_cfg, seed, routes)
        if best is None or obj < best[1]:
            best = (home, obj)
    assert best is not None
    return best[0], best[1], lpt_obj


def _solve_chunk(task: _LayerTask) -> list[tuple[np.ndarray, float, float]]:
    """Every seed on every layer of the chunk -> per layer (best home [E], best s, LPT start s)."""
    routes = link_routes(task.cost.cluster.nodes, task.cost.cluster.gpus_per_node)
    return [
        solve_layer(
            task.loads[:, i],
            task.cost,
            task.config,
            start=task.start_home[i],
            prev_home=None if task.prev_home is None else task.prev_home[i],
            layer=layer,
            seeds=task.seeds,
            routes=routes,
        )
        for i, layer in enumerate(task.layers)
    ]


class AnnealingReorderer:
    """ReLibra's reorderer (implements :class:`relibra.planner.Reorderer`), with ``config`` (default:
    :class:`AnnealConfig`'s defaults)."""

    def __init__(self, config: AnnealConfig | None = None) -> None:
        self.config = config if config is not None else AnnealConfig()

    @property
    def moves_samples(self) -> bool:
        """Whether :meth:`reorder` runs the locality round (which may move samples between GPUs)."""
        return self.config.locality

    def reorder(self, ctx: BatchContext) -> Reordering:
        """Placement ``home`` [L, E] for the batch, and (with ``locality``) a new ``sample_gpu`` [Sb].

        The two rounds are :meth:`place` (per layer) then :meth:`locality_step` (whole batch).
        Stats: ``reorder_objective_s`` and ``reorder_lpt_objective_s`` (true objective summed over layers, in
        seconds), ``reorder_moved_experts`` (experts whose home differs from ``ctx.prev_home``, or from the
        static Megatron placement on the first batch), ``reorder_time_s``, and the locality round's stats.
        """
        t0 = time.perf_counter()
        placed = self.place(ctx)
        stats = dict(placed.stats)
        sample_gpu = np.asarray(placed.sample_gpu, dtype=np.int32)
        if self.config.locality:
            sample_gpu, loc_stats = self.locality_step(ctx, placed.home)
            stats.update(loc_stats)
        stats["reorder_time_s"] = time.perf_counter() - t0
        return Reordering(home=placed.home, sample_gpu=sample_gpu, stats=stats)

    def place(self, ctx: BatchContext, layers: Sequence[int] | None = None) -> Reordering:
        """The first round alone: the annealed placement ``home`` [L, E] of ctx's layers; samples stay put.

        Args:
            ctx: the batch, or a slice of its layers (``counts`` [Sb, L', E], ``load`` [Mb, L', G, E],
                ``prev_home`` [L', E]) with the batch's own ``batch`` and ``seed``.
            layers: the batch-wide indices of ctx's ``L'`` layers (default ``0..L'-1``); each mixes into its
                layer's seed streams, so a slice planned with its indices gets exactly the rows that the
                whole batch's call gives (layers are independent in this round).
        Returns:
            A :class:`Reordering` with ``sample_gpu = ctx.sample_gpu`` and the stats of :meth:`reorder`
            except the locality round's and ``reorder_time_s``.
        """
        cfg = self.config
        load = np.asarray(ctx.load)
        if load.ndim != 4:
            raise ValueError(f"ctx.load has shape {load.shape}; expected [Mb, L, G, E]")
        _, num_layers, g, num_experts = load.shape
        if g != ctx.num_gpus:
            raise ValueError(f"ctx.load has G={g} GPUs but ctx.cluster has {ctx.num_gpus}")
        if num_experts % g != 0:
            raise ValueError(f"E={num_experts} experts is not divisible by G={g} GPUs")
        layer_ids = np.arange(num_layers) if layers is None else np.asarray(layers, dtype=np.int64)
        if layer_ids.shape != (num_layers,):
            raise ValueError(
                f"layers has {layer_ids.size} entries; expected one per layer of ctx.load ({num_layers})"
            )
        if cfg.objective == "aggregate":
            load = load.sum(axis=0, keepdims=True, dtype=np.int64)
        prev = None if ctx.prev_home is None else np.asarray(ctx.prev_home, dtype=np.int32)
        if prev is not None and prev.shape != (num_layers, num_experts):
            raise ValueError(
                f"ctx.prev_home has shape {prev.shape}; expected [L, E]=({num_layers}, {num_experts})"
            )
        lin = ctx.cost.linear()
        tokens_e = load.sum(axis=(0, 2), dtype=np.float64)  # [L, E]
        start = lpt_placement(
            lin.compute_s_per_token * tokens_e + lin.compute_s_per_expert * (tokens_e > 0), g
        )
        seeds = tuple(
            int(np.random.SeedSequence([s, ctx.seed, ctx.batch]).generate_state(1)[0]) for s in cfg.seeds
        )

        chunks = [c for c in np.array_split(np.arange(num_layers), min(cfg.workers, num_layers)) if c.size]
        tasks = [
            _LayerTask(
                layers=tuple(int(v) for v in layer_ids[c]),
                loads=load[:, c],
                prev_home=None if prev is None else prev[c],
                start_home=start[c],
                seeds=seeds,
                config=cfg,
                cost=ctx.cost,
            )
            for c in chunks
        ]
        if cfg.workers > 1 and len(tasks) > 1:
            with ProcessPoolExecutor(max_workers=len(tasks)) as pool:
                results = [r for chunk in pool.map(_solve_chunk, tasks) for r in chunk]
        else:
            results = [r for t in tasks for r in _solve_chunk(t)]
        home = np.stack([r[0] for r in results]).astype(np.int32)
        stats = {
            "reorder_objective_s": float(sum(r[1] for r in results)),
            "reorder_lpt_objective_s": float(sum(r[2] for r in results)),
        }
        ref = prev if prev is not None else static_placement(num_layers, num_experts, g)
        stats["reorder_moved_experts"] = float(np.count_nonzero(home != ref))
        return Reordering(home=home, sample_gpu=np.asarray(ctx.sample_gpu, dtype=np.int32), stats=stats)

    def locality_step(self, ctx: BatchContext, home: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """The second round alone: re-assign the whole batch's samples under placement ``home`` [L, E].

        Needs every layer (``ctx`` is the whole batch). Returns (``sample_gpu`` int32 [Sb], the
        ``locality_*`` stats of :func:`relibra.planners.locality.locality_round`); the input assignment
        and no stats when ``locality`` is off.
        """
        cfg = self.config
        if not cfg.locality:
            return np.asarray(ctx.sample_gpu, dtype=np.int32), {}
        return locality_round(
            ctx,
            np.asarray(home, dtype=np.int32),
            tolerance=cfg.locality_tolerance,
            iterations_per_sample=cfg.locality_iterations,
            seed=cfg.seeds[0],
        )
