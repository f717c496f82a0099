"""One layer's placement problem for the annealer: the LPT start and :class:`LayerProblem` (loads, compute
weights, link coefficients, migration and overlap terms) built from the cost model."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from relibra import numerics
from relibra.cost.migration import receive_seconds
from relibra.cost.model import CostModel
from relibra.planners.reorder.links import comm_coefficients
from relibra.planners.reorder.rail import integral_loads


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
    num_experts = load.shape[1]
    if num_gpus < 1 or num_experts % num_gpus != 0:
        raise ValueError(f"num_gpus={num_gpus} must be >= 1 and divide the number of experts E={num_experts}")
    if not np.isfinite(load).all():
        raise ValueError("load_e has non-finite entries; expected finite loads")
    order = np.argsort(-load, axis=1, kind="stable")  # [L, E]
    home = _lpt_rows(load, order, num_gpus, num_experts // num_gpus)
    return home[0] if squeeze else home


@njit(cache=True)
def _lpt_rows(load: np.ndarray, order: np.ndarray, num_gpus: int, per_gpu: int) -> np.ndarray:
    """:func:`lpt_placement`'s greedy per row of ``load`` [L, E], experts in ``order`` [L, E]: each onto
    the least-loaded GPU with a free slot, the lowest id among equals."""
    num_layers, num_experts = load.shape
    home = np.empty((num_layers, num_experts), dtype=np.int32)
    gpu_load = np.zeros(num_gpus)
    gpu_count = np.zeros(num_gpus, dtype=np.int64)
    for row in range(num_layers):
        gpu_load[:] = 0.0
        gpu_count[:] = 0
        for i in range(num_experts):
            e = order[row, i]
            g = -1
            for c in range(num_gpus):
                if gpu_count[c] < per_gpu and (g < 0 or gpu_load[c] < gpu_load[g]):
                    g = c
            home[row, e] = g
            gpu_load[g] += load[row, e]
            gpu_count[g] += 1
    return home


# -------------------------------------------------------------------------------- one layer's problem
@dataclass(frozen=True)
class LayerProblem:
    """One layer's reordering problem in normalised units (times divided by ``scale`` seconds)."""

    x: np.ndarray
    """float64 [Mb, E, G]: tokens of expert ``e`` held by source GPU ``j`` (transposed ``x[m, j, e]``)."""
    w: np.ndarray
    """float64 [Mb, E]: normalised compute time of expert ``e`` (per-token + fixed per non-empty expert)."""
    coef: np.ndarray
    """float64 [5]: normalised NVLink and NIC time per token in a dispatch phase, the same in a combine phase,
    and the normalised fixed latency (:func:`~relibra.planners.reorder.links.comm_coefficients`)."""
    mig: np.ndarray
    """float64 [E, G]: weighted normalised migration time if expert ``e`` is homed on ``g`` (0: no charge)."""
    scale: float
    """Seconds per normalised unit (the mean per-GPU compute time of a micro-batch)."""
    compute_group: int = 1
    """GPUs pooled in the compute term: 1 (per-GPU max) or ``gpus_per_node`` (per-node mean, then max)."""
    lq: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    """float64 [Mb, E, G(j)]: ``log(1 - x[m, j, e] / T_j)`` for the ``deepep`` dispatcher's estimate
    (:func:`relibra.cost.fabric.deepep_link_tokens_estimate`); empty for ``alltoall``."""
    tok: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """float64 [Mb, G(j)]: tokens held by each source (``deepep``; empty for ``alltoall``)."""
    attn: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """float64 [Mb]: normalised attention (fwd + bwd, busiest GPU) of each row, which the overlap's compute
    includes (``cluster.ep_overlap``); empty without the overlap."""
    overlap_mbs: int = 0
    """Micro-batches the rows stand for under ``cluster.ep_overlap`` (``Mb``, or the batch's count for the
    aggregate row); 0: no overlap, the objective sums the rows' ``T_MoE``."""
    contention: float = 0.0
    """The overlapped all-to-all's SM share (:attr:`relibra.cluster.ClusterSpec.comm_sm_share`; 0 without
    the overlap)."""

    integral: bool = field(init=False)
    """Whether ``x`` holds whole numbers (:func:`relibra.planners.reorder.rail.integral_loads`): derived once
    here, read by every annealing run and pricing of the problem (the route-class path)."""

    def __post_init__(self) -> None:
        # The kernels index ``coef`` without bounds checks: a short vector would read memory past its end.
        if np.shape(self.coef) != (5,):
            raise ValueError(f"coef has shape {np.shape(self.coef)}; expected [5] (comm_coefficients)")
        object.__setattr__(self, "integral", bool(integral_loads(np.asarray(self.x, dtype=np.float64))))

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
    attention: np.ndarray | None = None,
    microbatches: int | None = None,
) -> LayerProblem:
    """Normalise one layer's loads ``load_l`` [Mb, G, E] (one row per micro-batch) into a problem.

    ``prev_home`` [E] (the previous placement) and ``migration_weight`` define the migration charge: the
    weight times the seconds each GPU needs to receive the experts newly homed on it, priced with
    ``cost.migration`` (:func:`relibra.cost.migration.receive_seconds`, the simulator's payload and path);
    ``compute_level`` (``gpu`` or ``node``, see :class:`AnnealConfig`) the compute term, ``comm_weight``
    the weight of the communication term (its latency constant included). Under ``cluster.ep_overlap``
    (read from ``cost``) the objective is :func:`relibra.cost.overlap.layer_time` of the rows: ``attention``
    [Mb] seconds (fwd + bwd, busiest GPU; the placement does not change it, but the overlap's compute
    holds it; default 0) join each row's compute, and ``microbatches`` (default ``Mb``) is how many
    micro-batches the rows stand for (the batch's count for one aggregate row).
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
    if not (math.isfinite(comm_weight) and comm_weight >= 0):
        raise ValueError(f"comm_weight={comm_weight}; expected a finite number >= 0")
    coef = comm_weight * comm_coefficients(cost) / scale
    mig = np.zeros((e, g))
    if prev_home is not None and migration_weight > 0:
        prev = np.asarray(prev_home, dtype=np.int64)
        if prev.shape != (e,):
            raise ValueError(f"prev_home has shape {prev.shape}; expected [E]=({e},)")
        mig = migration_weight * receive_seconds(cost, prev) / scale
    x = np.ascontiguousarray(load_l.transpose(0, 2, 1), dtype=np.float64)
    group = cost.cluster.domain_gpus if compute_level == "node" else 1
    attn, overlap_mbs = np.zeros(0), 0
    if cost.cluster.ep_overlap:
        overlap_mbs = mb if microbatches is None else int(microbatches)
        if overlap_mbs < 2 or mb not in (1, overlap_mbs):
            raise ValueError(
                f"cluster.ep_overlap: load_l has {mb} rows standing for microbatches={overlap_mbs}; the "
                "overlap needs at least 2 micro-batches, given one row each or as one aggregate row"
            )
        attn = np.zeros(mb) if attention is None else np.asarray(attention, dtype=np.float64) / scale
        if attn.shape != (mb,):
            raise ValueError(f"attention has shape {attn.shape}; expected one value per row [Mb]=({mb},)")
    lq, tok = np.zeros((0, 0, 0)), np.zeros((0, 0))
    if cost.dispatcher == "deepep":
        tok = load_l.sum(axis=2, dtype=np.float64) / cost.model.top_k  # [Mb, G]
        q = np.divide(x, tok[:, None, :], out=np.zeros_like(x), where=tok[:, None, :] > 0)
        lq = np.ascontiguousarray(numerics.log1p(-np.minimum(q, 1.0 - 1e-12)))
    return LayerProblem(
        x=x,
        w=w_s / scale,
        coef=coef,
        mig=np.ascontiguousarray(mig),
        scale=scale,
        compute_group=group,
        lq=lq,
        tok=np.ascontiguousarray(tok),
        attn=np.ascontiguousarray(attn),
        overlap_mbs=overlap_mbs,
        contention=cost.cluster.comm_sm_share,
    )
