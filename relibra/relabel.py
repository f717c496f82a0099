"""Relabel a new placement to keep experts where they are, at no change of its step time.

A planner that re-plans from scratch (ReLibra's annealer, EPLB+, LPLB+) finds one of many equivalent
placements: the cost model (:mod:`relibra.cost.model`) prices a plan the same after any relabelling of GPUs
that maps the fabric onto itself, applied to everything the plan puts on a GPU at once (home experts, replica
and redundant slots, token assignment, samples). On the rail-optimized fabric those relabellings are

* a permutation ``pi`` of the nodes (every node is alike), together with
* one permutation ``sigma`` of the rails, the same in every node (GPU ``(n, r)`` -> ``(pi(n), sigma(r))``):
  same-node pairs stay same-node, same-rail pairs stay same-rail, so every link class keeps its bytes.

Permuting the GPUs of one node alone is *not* free (it turns same-rail inter-node traffic into cross-rail
traffic), nor is moving experts without their samples (it changes what stays local); permuting the slots
within one GPU changes nothing at all. Samples are shared by all layers, so one relabelling serves every
layer of the batch.

:func:`keep_in_place` picks the relabelling that keeps the most experts on their previous GPU (ties: the
most in their previous node), by alternating two linear assignment problems
(OR-Tools' ``SimpleLinearSumAssignment``): the node permutation for a fixed rail permutation, then the
rail permutation for a fixed node permutation, from the identity until neither improves. Each step is
optimal given the other, so the result never keeps fewer experts in place than the plan as given (it
moves no more experts), and it is exact when there is one node or one rail.

Under tensor or context parallelism (``parallel.tp * parallel.cp = n > 1``, :mod:`relibra.parallel`) a GPU's
rail is also its rank in a TP x CP group of ``n`` consecutive GPUs, which holds its samples' ranks and runs
their collectives, so a rail permutation is no longer free: the relabelling permutes whole nodes only
(``sigma`` the identity), and nothing when a group spans several nodes.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from ortools.graph.python import linear_sum_assignment

from relibra.planners.protocols import BatchContext, previous_home
from relibra.types import BatchPlan

__all__ = ["keep_in_place", "permute_plan", "relabel_for", "relabel_plan"]

MAX_ROUNDS = 16
"""Alternations of the two assignment problems at most (each round keeps at least as many in place)."""


def _assign(weight: np.ndarray) -> np.ndarray:
    """The permutation ``p`` maximising ``sum_i weight[i, p[i]]`` (weight: non-negative integers [n, n])."""
    n = weight.shape[0]
    w = np.asarray(np.rint(weight), dtype=np.int64)
    solver = linear_sum_assignment.SimpleLinearSumAssignment()
    rows, cols = np.divmod(np.arange(n * n), n)
    solver.add_arcs_with_cost(rows, cols, (w.max() - w).ravel())  # minimise the shortfall
    if solver.solve() != solver.OPTIMAL:
        raise RuntimeError("relabelling: the linear assignment problem found no optimum")
    return np.array([solver.right_mate(i) for i in range(n)], dtype=np.int64)


def _score(stay: np.ndarray, pi: np.ndarray, sigma: np.ndarray, big: float) -> float:
    """``big * (experts kept on their GPU) + (experts kept in their node)``; stay [N, N, R, R]."""
    nodes = np.arange(stay.shape[0])
    on_node = stay[nodes, pi]  # [N, R, R]
    return float(big * on_node[:, np.arange(stay.shape[2]), sigma].sum() + on_node.sum())


def keep_in_place(
    new_home: np.ndarray, prev_home: np.ndarray, nodes: int, gpus_per_node: int, group: int = 1
) -> np.ndarray:
    """The fabric-preserving GPU relabelling that keeps the most experts on their previous GPU.

    Args:
        new_home: int [L, E] the new placement; prev_home: int [L, E] the previous one.
        nodes: ``N``; gpus_per_node: ``R`` (``G = N * R``, GPU ``g`` is node ``g // R``, rail ``g % R``);
        group: GPUs of a TP x CP group (module doc: > 1 keeps the rails, > ``R`` keeps every label).
    Returns:
        int64 [G]: ``perm[g]`` is the label GPU ``g`` of ``new_home`` gets (``perm[new_home]`` is relabelled).
    """
    new = np.asarray(new_home, dtype=np.int64).ravel()
    prev = np.asarray(prev_home, dtype=np.int64).ravel()
    if new.shape != prev.shape:
        raise ValueError(f"new_home {np.shape(new_home)} and prev_home {np.shape(prev_home)} differ in shape")
    r = gpus_per_node
    # stay[a, b, s, t]: experts on node a, rail s of the new placement that were on node b, rail t.
    stay = np.zeros((nodes, nodes, r, r))
    np.add.at(stay, (new // r, prev // r, new % r, prev % r), 1.0)
    big = float(new.size + 1)
    pi = np.arange(nodes)
    sigma = np.arange(r)
    if group > r:
        return np.arange(nodes * r)
    if group > 1:
        pi_new = _node_only(stay, big)
        if _score(stay, pi_new, sigma, big) > _score(stay, pi, sigma, big):
            pi = pi_new
        g = np.arange(nodes * r)
        return pi[g // r] * r + g % r
    best = _score(stay, pi, sigma, big)
    for _ in range(MAX_ROUNDS):
        # Step 1: nodes, for the rail permutation fixed.
        w_node = big * stay[:, :, np.arange(r), sigma].sum(axis=-1) + stay.sum(axis=(2, 3))  # [N, N]
        pi_new = _assign(w_node)
        # Step 2: rails, for the node permutation fixed.
        w_rail = stay[np.arange(nodes), pi_new].sum(axis=0)  # [R, R]
        sigma_new = _assign(w_rail)
        score = _score(stay, pi_new, sigma_new, big)
        if score <= best:
            break
        best, pi, sigma = score, pi_new, sigma_new
    g = np.arange(nodes * r)
    return pi[g // r] * r + sigma[g % r]


def _node_only(stay: np.ndarray, big: float) -> np.ndarray:
    """The node permutation with the rails kept (one assignment problem; stay [N, N, R, R])."""
    r = stay.shape[2]
    return _assign(big * stay[:, :, np.arange(r), np.arange(r)].sum(axis=-1) + stay.sum(axis=(2, 3)))


def permute_plan(plan: BatchPlan, perm: np.ndarray) -> BatchPlan:
    """The plan with GPU ``g`` renamed ``perm[g]`` everywhere (perm int [G], a permutation)."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.argsort(perm)  # inv[new label] = old GPU
    return replace(
        plan,
        home=perm[plan.home].astype(np.int32),
        assign=np.ascontiguousarray(plan.assign[..., inv]),
        load=np.ascontiguousarray(plan.load[:, :, inv, :]),
        sample_gpu=perm[plan.sample_gpu].astype(np.int32),
        replicas=None if plan.replicas is None else np.ascontiguousarray(plan.replicas[:, :, inv, :]),
        redundant=None if plan.redundant is None else np.ascontiguousarray(plan.redundant[:, inv, :]),
    )


def relabel_plan(
    plan: BatchPlan, prev_home: np.ndarray, nodes: int, gpus_per_node: int, group: int = 1
) -> BatchPlan:
    """``plan`` relabelled by :func:`keep_in_place` against ``prev_home`` [L, E] (``group``: GPUs of a TP x
    CP group); the same step time, the
    same experts per GPU up to the relabelling, at most as many moved experts. ``stats`` gains
    ``relabel_kept_experts`` (experts the relabelling kept in place beyond the plan as given) and an
    updated ``reorder_moved_experts``."""
    perm = keep_in_place(plan.home, prev_home, nodes, gpus_per_node, group)
    out = permute_plan(plan, perm)
    prev = np.asarray(prev_home)
    before = int(np.count_nonzero(plan.home != prev))
    after = int(np.count_nonzero(out.home != prev))
    stats = {
        **plan.stats,
        "relabel_kept_experts": float(before - after),
        "reorder_moved_experts": float(after),
    }
    return replace(out, stats=stats)


def relabel_for(plan: BatchPlan, ctx: BatchContext) -> BatchPlan:
    """:func:`relabel_plan` against the placement the batch starts from (:func:`previous_home`)."""
    return relabel_plan(
        plan, previous_home(ctx), ctx.cluster.num_domains, ctx.cluster.domain_gpus, ctx.cost.parallel.group
    )
