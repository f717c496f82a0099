"""Megatron's EP all-to-all overlap: ``cluster.ep_overlap`` (``overlap_moe_expert_parallel_comm``).

Megatron-core's combined 1F1B schedule (``core.pipeline_parallel.combined_1f1b``) runs the forward of one
micro-batch together with the backward of the previous one, layer by layer: the forward's dispatch and
combine all-to-all hide behind the backward's attention and expert computation, and the backward's
behind the forward's. With ``M`` micro-batches in a step the pairs are ``(F[m + 1], B[m])`` for
``m < M - 1``; the first forward and the last backward run alone, so at least two micro-batches are
needed for any overlap. Per layer and pair (:func:`pair_time`):

    t = max(comm_F[m + 1], comp_B[m]) + max(comm_B[m], comp_F[m + 1])

where ``comp`` is the layer's expert GEMMs plus attention of that pass (forward a third of forward plus
backward, backward two thirds, as the cost model counts FLOPs) and ``comm`` its two all-to-all phases
(dispatch and combine; half of the four). What the compute does not cover is the exposed communication.

**SM contention** (``contention`` below, :attr:`relibra.cluster.ClusterSpec.comm_sm_share`): the dispatch and
combine kernels hold ``s`` of the GPU's SMs while they run, so the compute beside them runs at ``1 - s`` of
its rate for that time: a compute of ``C`` seconds beside an all-to-all of ``K`` takes ``max(K, C + s K)``
(the compute loses ``s K`` of SM time; if it still fits inside ``K``, ``K`` bounds the pair). Each max
above becomes ``max(K/2, 2 C/3 + s K/2)``; the communication's own speed is taken as unchanged, and a
pass that runs alone (no partner) has nothing to contend with. ``s = 0`` is the rule above, bit for bit.

This module is the one place of the rule: the simulator prices a step with :func:`overlapped_time`, and the
planners' objectives call the same compiled functions (:func:`layer_time` for one layer's micro-batches,
:func:`microbatch_share` for the terms one micro-batch enters, given its neighbours; :func:`share_pieces`
for the same terms as affine pieces, which the replication MILP and LP minimise). Every one of them evaluates
the coefficients of :func:`share_term`, the rule's single statement. With ``beta < inf``
every ``max`` of two is the log-sum-exp ``max + log1p(exp(-beta |a - b|)) / beta`` (the annealer's
smoothing); ``beta = inf`` is the hard max the simulator charges.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

__all__ = [
    "BWD_COMPUTE",
    "FWD_COMPUTE",
    "PASS_COMM",
    "OverlapNeighbours",
    "best_chain",
    "layer_time",
    "microbatch_share",
    "overlapped_time",
    "pair_time",
    "share_pieces",
    "share_term",
]

FWD_COMPUTE = 1.0 / 3.0
"""Forward share of a layer's fwd + bwd compute (backward has twice the forward's FLOPs)."""
BWD_COMPUTE = 2.0 / 3.0
"""Backward share of a layer's fwd + bwd compute."""
PASS_COMM = 0.5
"""Share of a layer's four all-to-all phases in one pass (dispatch and combine)."""


@njit(cache=True, inline="always")
def _smax(a: float, b: float, beta: float) -> float:
    """``max(a, b)``; for finite ``beta`` its log-sum-exp ``LSE_beta(a, b)`` (never below the max)."""
    m = a if a > b else b
    if beta == math.inf:
        return m
    return m + math.log1p(math.exp(-beta * abs(a - b))) / beta


@njit(cache=True, inline="always")
def share_term(
    side: int, piece: int, arg: int, comp_nb: float, comm_nb: float, contention: float
) -> tuple[float, float, float]:
    """The one statement of the overlap rule: coefficients ``(of C, of K, constant)`` of argument ``arg``
    (0 or 1) of the ``piece``-th (0 or 1) max of two in the terms micro-batch ``m`` (compute ``C``,
    all-to-all ``K``) enters on ``side``: 0 its forward beside the backward of ``m - 1``, 1 its backward
    beside the forward of ``m + 1``. ``(comp_nb, comm_nb)``: that neighbour's compute and all-to-all; a
    negative ``comp_nb`` where there is none (the pass runs alone: ``C/3 + K/2`` or ``2 C/3 + K/2``, no max).
    A constant of ``-inf`` marks an argument that does not exist (the max is its other argument).
    ``contention``: the SM share ``s`` of the all-to-all (module doc).

    side 0: ``max(K/2, 2 C[m-1]/3 + s K/2) + max(K[m-1]/2, C/3 + s K[m-1]/2)``; side 1: ``max(K[m+1]/2,
    2 C/3 + s K[m+1]/2) + max(K/2, C[m+1]/3 + s K/2)``. Every coefficient is >= 0, so the terms are
    non-decreasing in ``C`` and ``K``.
    """
    if comp_nb < 0.0:
        if arg == 1:
            return 0.0, 0.0, -math.inf
        if piece == 1:
            return 0.0, 0.0, 0.0
        return (FWD_COMPUTE if side == 0 else BWD_COMPUTE), PASS_COMM, 0.0
    if side == 0:
        if piece == 0:
            return (0.0, PASS_COMM, 0.0) if arg == 0 else (0.0, contention * PASS_COMM, BWD_COMPUTE * comp_nb)
        return (
            (0.0, 0.0, PASS_COMM * comm_nb)
            if arg == 0
            else (FWD_COMPUTE, 0.0, contention * PASS_COMM * comm_nb)
        )
    if piece == 0:
        return (
            (0.0, 0.0, PASS_COMM * comm_nb)
            if arg == 0
            else (BWD_COMPUTE, 0.0, contention * PASS_COMM * comm_nb)
        )
    return (0.0, PASS_COMM, 0.0) if arg == 0 else (0.0, contention * PASS_COMM, FWD_COMPUTE * comp_nb)


@njit(cache=True, inline="always")
def _side(
    side: int, comp_nb: float, comm_nb: float, comp: float, comm: float, beta: float, contention: float
) -> float:
    """Seconds of the terms of :func:`share_term` on ``side`` at ``(comp, comm)``."""
    t = 0.0
    for piece in range(2):
        a0, b0, c0 = share_term(side, piece, 0, comp_nb, comm_nb, contention)
        a1, b1, c1 = share_term(side, piece, 1, comp_nb, comm_nb, contention)
        t += _smax(a0 * comp + b0 * comm + c0, a1 * comp + b1 * comm + c1, beta)
    return t


@njit(cache=True, inline="always")
def pair_time(
    comp_b: float, comm_b: float, comp_f: float, comm_f: float, beta: float, contention: float
) -> float:
    """Seconds of one overlapped pair: the backward of a micro-batch (``comp_b``, ``comm_b``: its fwd + bwd
    compute and four-phase all-to-all) with the forward of the next (``comp_f``, ``comm_f``), the
    all-to-all holding ``contention`` of the SMs (module doc)."""
    return _side(0, comp_b, comm_b, comp_f, comm_f, beta, contention)


@njit(cache=True, inline="always")
def _alone(side: int, comp: float, comm: float, beta: float) -> float:
    """Seconds of the first forward (``side`` 0) or the last backward (1), which run without a partner
    (nothing to contend with)."""
    return _side(side, -1.0, 0.0, comp, comm, beta, 0.0)


@njit(cache=True)
def layer_time(
    comp: np.ndarray, comm: np.ndarray, microbatches: int, beta: float, contention: float
) -> float:
    """Seconds of one layer over a step's micro-batches under the overlap.

    comp [R], comm [R]: each row's fwd + bwd compute (expert GEMMs and attention) and four-phase all-to-all.
    ``R == microbatches``: the rows are the step's micro-batches in order (the first forward and the last
    backward alone, every other pass paired). ``R == 1`` with ``microbatches > 1``: the row is the sum of
    ``microbatches`` micro-batches taken as equal (the annealer's aggregate objective), i.e.
    ``(comp + comm + (microbatches - 1) * pair_time(comp, comm, comp, comm)) / microbatches``.
    ``contention``: the all-to-all's SM share (module doc).
    """
    rows = comp.shape[0]
    if rows == 1 and microbatches > 1:
        c = comp[0]
        k = comm[0]
        return (c + k + (microbatches - 1) * pair_time(c, k, c, k, beta, contention)) / microbatches
    total = _alone(0, comp[0], comm[0], beta)
    for m in range(rows - 1):
        total += pair_time(comp[m], comm[m], comp[m + 1], comm[m + 1], beta, contention)
    total += _alone(1, comp[rows - 1], comm[rows - 1], beta)
    return total


@njit(cache=True)
def microbatch_share(
    comp: float, comm: float, neighbours: np.ndarray, beta: float, contention: float
) -> float:
    """The terms of :func:`layer_time` that micro-batch ``m`` enters, given its neighbours.

    comp, comm: ``m``'s fwd + bwd compute and all-to-all seconds; neighbours [4]: ``(comp, comm)`` of
    ``m - 1`` then of ``m + 1``, a negative ``comp`` where there is none (``m`` first or last). The rest of
    the layer's time does not depend on ``m``, so minimising this over ``m``'s plan with its neighbours
    fixed minimises :func:`layer_time`.
    """
    return _side(0, neighbours[0], neighbours[1], comp, comm, beta, contention) + _side(
        1, neighbours[2], neighbours[3], comp, comm, beta, contention
    )


@njit(cache=True)
def share_pieces(neighbours: np.ndarray, contention: float) -> np.ndarray:
    """:func:`microbatch_share` (hard max) as a sum of maxima of affine terms, for a linear program.

    neighbours [4] as :func:`microbatch_share`'s. Returns float64 [4, 2, 3]: piece ``p`` (two per side, in
    order) is ``max_i (out[p, i, 0] * C + out[p, i, 1] * K + out[p, i, 2])``, the share their sum; a
    constant ``-inf`` marks an argument that does not exist (:func:`share_term`). Each max becomes an
    epigraph variable ``t_p >= term_i`` in the MILP and LP of :mod:`relibra.planners.replicate.milp`.
    """
    out = np.empty((4, 2, 3))
    for side in range(2):
        for piece in range(2):
            for arg in range(2):
                a, b, c = share_term(
                    side, piece, arg, neighbours[2 * side], neighbours[2 * side + 1], contention
                )
                out[2 * side + piece, arg, 0] = a
                out[2 * side + piece, arg, 1] = b
                out[2 * side + piece, arg, 2] = c
    return out


@dataclass(frozen=True)
class OverlapNeighbours:
    """What a per-micro-batch planner needs to price micro-batch ``m``'s layers under the overlap: the terms
    of :func:`microbatch_share` that are not its own plan."""

    attention: np.ndarray
    """float64 [L]: ``m``'s attention seconds per layer (fwd + bwd, busiest GPU), part of its compute."""
    neighbours: np.ndarray
    """float64 [L, 4]: per layer ``(compute, comm)`` seconds of micro-batch ``m - 1``, then of ``m + 1``
    (compute with attention), compute ``-1`` where there is none."""
    contention: float
    """The all-to-all's SM share (:attr:`relibra.cluster.ClusterSpec.comm_sm_share`; module doc)."""

    def __post_init__(self) -> None:
        a, n = np.shape(self.attention), np.shape(self.neighbours)
        if len(a) != 1 or n != (a[0], 4):
            raise ValueError(f"OverlapNeighbours: attention {a} must be [L] and neighbours {n} [L, 4]")

    def rows(self, index: np.ndarray) -> OverlapNeighbours:
        """The same for the layers ``index`` (int [L'])."""
        return OverlapNeighbours(self.attention[index], self.neighbours[index], self.contention)

    @staticmethod
    def of(
        compute: np.ndarray, comm: np.ndarray, attention: np.ndarray, m: int, contention: float
    ) -> OverlapNeighbours:
        """Micro-batch ``m``'s neighbours in a step whose micro-batches have compute [M, L] (with attention)
        and comm [M, L] seconds; attention [M] (or [M, L]) is each micro-batch's own per layer."""
        comp, com = np.asarray(compute, dtype=np.float64), np.asarray(comm, dtype=np.float64)
        num_layers = comp.shape[1]
        nb = np.tile(np.array([-1.0, 0.0, -1.0, 0.0]), (num_layers, 1))
        if m > 0:
            nb[:, 0], nb[:, 1] = comp[m - 1], com[m - 1]
        if m < comp.shape[0] - 1:
            nb[:, 2], nb[:, 3] = comp[m + 1], com[m + 1]
        own = np.broadcast_to(np.asarray(attention, dtype=np.float64)[m], (num_layers,))
        return OverlapNeighbours(np.ascontiguousarray(own), nb, contention)


@njit(cache=True)
def best_chain(comp: np.ndarray, comm: np.ndarray, extra: np.ndarray, contention: float) -> np.ndarray:
    """The candidate of each micro-batch whose combination minimises one layer's overlapped time.

    comp, comm, extra [C, M]: candidate ``c``'s compute (with attention), all-to-all and other additive
    seconds (exposed refill) for micro-batch ``m``; ``contention`` the all-to-all's SM share. The layer's
    time is a chain of :func:`pair_time` terms, so dynamic programming over ``m`` (C x C per step) finds the
    exact best mix. Returns int64 [M].
    """
    num_c, num_m = comp.shape
    best = np.empty((num_m, num_c))
    back = np.zeros((num_m, num_c), dtype=np.int64)
    for c in range(num_c):
        best[0, c] = _alone(0, comp[c, 0], comm[c, 0], math.inf) + extra[c, 0]
    for m in range(1, num_m):
        for c in range(num_c):
            top = math.inf
            for d in range(num_c):
                v = best[m - 1, d] + pair_time(
                    comp[d, m - 1], comm[d, m - 1], comp[c, m], comm[c, m], math.inf, contention
                )
                if v < top:
                    top = v
                    back[m, c] = d
            best[m, c] = top + extra[c, m]
    last = num_m - 1
    out = np.zeros(num_m, dtype=np.int64)
    top = math.inf
    for c in range(num_c):
        v = best[last, c] + _alone(1, comp[c, last], comm[c, last], math.inf)
        if v < top:
            top = v
            out[last] = c
    for m in range(last, 0, -1):
        out[m - 1] = back[m, out[m]]
    return out


def overlapped_time(compute: np.ndarray, comm: np.ndarray, contention: float) -> tuple[float, float]:
    """(seconds of the step's MoE layers, exposed communication seconds) under the combined 1F1B overlap.

    compute [M, L]: forward plus backward seconds of each (micro-batch, layer)'s expert GEMMs and
    attention; comm [M, L]: its four all-to-all phases; contention: the all-to-all's SM share in [0, 1]
    (module doc). Without overlap the time would be ``compute.sum() + comm.sum()``; the result never
    exceeds that, nor falls below ``compute.sum()``. The exposed seconds include the compute slowed by
    the contention.
    """
    comp = np.asarray(compute, dtype=np.float64)
    com = np.asarray(comm, dtype=np.float64)
    if comp.shape[0] < 2:
        raise ValueError(
            f"cluster.ep_overlap needs at least 2 micro-batches in a step to overlap; got {comp.shape[0]}"
        )
    total = _step_time(np.ascontiguousarray(comp.T), np.ascontiguousarray(com.T), float(contention))
    return total, total - float(comp.sum())


@njit(cache=True)
def _step_time(comp: np.ndarray, comm: np.ndarray, contention: float) -> float:
    """:func:`layer_time` (hard max) summed over layers; comp, comm [L, M]."""
    total = 0.0
    for layer in range(comp.shape[0]):
        total += layer_time(comp[layer], comm[layer], comp.shape[1], math.inf, contention)
    return total
