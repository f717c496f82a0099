"""ReLibra's intra-batch replication: incremental greedy replica placement with a water-filling token split.

One problem is one (micro-batch, layer): loads ``x[j, e]`` (source GPU ``j``, expert ``e``) and the
placement ``home[e]`` are fixed; each GPU has ``r`` replica slots (the layer-shared buffer) that may hold
copies of experts whose home is on the **same node**. The greedy (paper, "intra-batch replication"):

1. compute step: find the bottleneck GPU (largest linearised compute); take its experts by decreasing
   tokens; for the first one whose copy helps, add a copy on the least-loaded GPU of the node that has a
   free slot and no copy of it yet; re-solve the token split;
2. communication step (``acceptance`` ``"comm"`` / ``"best"``, when no compute step helps), at the GPU with
   the busiest links: where NVLink binds it, a copy on it of an expert whose demand is mostly its own
   (by ``x[gc, e] / (tokens + fixed)``), holding all of that expert's tokens or else water-filled, with up
   to :data:`LOOKAHEAD` follow-up moves that relieve that GPU (the send side); failing that, a second
   copy, water-filled or holding all tokens, of
   an expert that GPU receives many remote tokens for, on the node's GPU with the least busy links (the
   receive side);
3. keep a move only if the objective drops: the compute max (``"compute"``) or the linearised
   ``T_comp_max + T_comm_max`` (``"comm"``; :meth:`relibra.cost.model.CostModel.linear`); ``"best"`` runs
   ``"comm"``, ``"comm"`` with the communication step first (where NVLink binds the busiest GPU), and
   ``"compute"`` cut where its ``T_MoE`` was lowest, and keeps the lowest ``T_MoE``;
4. stop when no move improves the objective or no slot is left (under ``cluster.ep_overlap`` the
   objective is the micro-batch's share of the overlapped layer time given its neighbours,
   :func:`relibra.cost.overlap.microbatch_share`; see :mod:`relibra.planners.refill` and docs/replicate.md);
5. optionally (``polish_moves > 0``) polish the result with exchange moves: drop one copy, add another in
   the same node, keep the first exchange that lowers the objective (:func:`_polish`).

The split is solved two ways:

* ``split="waterfill"`` (default): compute-only, in closed form. Given the other loads ``b[g]`` of an
  expert's copies, its ``A`` tokens fill the copies up to one level ``lambda`` with
  ``sum_g max(0, lambda - b[g]) = A``. A few sweeps of this over the node's replicated experts converge to
  the split that minimises the sum of squared GPU loads, which for this splittable restricted-assignment
  problem is also the min-max split (the lexicographically optimal base of a polymatroid, Fujishige).
  Compiled with numba: 0.1-0.7 ms per problem at EP 8-64 (docs/records/replicate.md, "Speed"). A candidate's
  communication term is evaluated incrementally: only the traffic columns of the node whose split changed
  are rebuilt, and a candidate whose compute max plus an O(G) lower bound on one GPU's communication
  already misses the threshold is rejected without the O(G^2) pass (docs/replicate.md).
* ``split="lp"``: the general case. Every candidate's split is the LP of the paper's eq. 7 with the replica
  set fixed (:func:`relibra.planners.replicate.milp.solve_split`), including the communication terms.

Tokens are then rounded to int32 per expert with the largest-remainder rule, so that
``assign[e, :].sum() == sum_j x[j, e]`` exactly; slots whose copy ends with no tokens are emptied.
Work is measured in *token equivalents*: compute seconds divided by ``compute_s_per_token``, so an expert
costs ``tokens + gemm_half_tokens`` on every GPU that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

import numpy as np

from relibra.cost.model import CostModel
from relibra.cost.overlap import OverlapNeighbours
from relibra.planners.protocols import BatchContext, Replication
from relibra.planners.replicate.search import _greedy_batch
from relibra.planners.replicate.terms import ReplicationCoefficients, round_assign

SplitMethod = Literal["waterfill", "lp"]
Acceptance = Literal["best", "comm", "compute"]
_MODES = {"compute": 0, "comm": 1, "best": 2}

__all__ = [
    "Acceptance",
    "GreedyConfig",
    "GreedyReplicator",
    "ReplicationCoefficients",
    "SplitMethod",
    "linear_objective",
    "replicate_greedy",
    "round_assign",
]


# ------------------------------------------------------------------------------------------- public API
def _check(load: np.ndarray, home: np.ndarray, num_gpus: int, gpus_per_node: int, r: int) -> None:
    if load.ndim < 2 or load.shape[-2] != num_gpus:
        raise ValueError(f"load must be [..., G={num_gpus}, E], got shape {load.shape}")
    if home.shape != load.shape[:-2] + load.shape[-1:]:
        raise ValueError(f"home must be [..., E] = {load.shape[:-2] + load.shape[-1:]}, got {home.shape}")
    if home.size and (home.min() < 0 or home.max() >= num_gpus):
        raise ValueError(f"home ids must lie in [0, {num_gpus}), got [{home.min()}, {home.max()}]")
    if num_gpus % gpus_per_node != 0:
        raise ValueError(f"G={num_gpus} is not a multiple of gpus_per_node={gpus_per_node}")
    if r < 0:
        raise ValueError(f"replica_slots must be >= 0, got {r}")
    if np.any(load < 0):
        raise ValueError("load must be non-negative token counts")


@dataclass(frozen=True)
class GreedyConfig:
    """Settings of :class:`GreedyReplicator`. These defaults are the only ones: the Hydra node
    ``planner/replicate/greedy`` is generated from them (:mod:`experiments.config.planner_nodes`); the
    arguments are those of :func:`replicate_greedy`."""

    split: SplitMethod = "waterfill"
    """Token split: ``waterfill`` (compute-only closed form, compiled) or ``lp`` (eq. 7 LP with the
    communication terms, slow)."""
    acceptance: Acceptance = "best"
    """Which copies the greedy keeps: ``best`` (the better of the rules), ``comm`` (those lowering
    ``T_comp max + T_comm max``) or ``compute`` (those lowering ``T_comp max``)."""
    sweeps: int = 3
    max_tries: int = 4
    polish_moves: int = 0
    """Exchange moves after the greedy (drop one copy, add another in the node) while they lower ``T_MoE``;
    0: off."""
    polish_candidates: int = 3
    refill_aware: bool = True
    """Behind a planner, keep only copies that pay for their replica-buffer refill
    (:func:`relibra.planners.refill.replicate_within_window`); False: ``T_MoE`` alone, as the paper."""

    def __post_init__(self) -> None:
        if self.split not in get_args(SplitMethod):
            raise ValueError(f"split={self.split!r}; expected one of {list(get_args(SplitMethod))}")
        if self.acceptance not in get_args(Acceptance):
            raise ValueError(f"acceptance={self.acceptance!r}; expected one of {list(get_args(Acceptance))}")
        counts = (
            ("sweeps", self.sweeps, 1),
            ("max_tries", self.max_tries, 0),
            ("polish_moves", self.polish_moves, 0),
            ("polish_candidates", self.polish_candidates, 1),
        )
        for key, value, least in counts:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key}={value!r}; expected an integer >= {least}")


def replicate_greedy(
    load: np.ndarray,
    home: np.ndarray,
    cost: CostModel,
    replica_slots: int,
    *,
    split: SplitMethod = GreedyConfig.split,
    acceptance: Acceptance = GreedyConfig.acceptance,
    sweeps: int = GreedyConfig.sweeps,
    max_tries: int = GreedyConfig.max_tries,
    rel_tol: float = 1e-9,
    polish_moves: int = GreedyConfig.polish_moves,
    polish_candidates: int = GreedyConfig.polish_candidates,
    overlap: OverlapNeighbours | None = None,
) -> Replication:
    """Greedy replication of every problem in a stack.

    Args:
        load: [..., G, E] tokens of source GPU ``j`` for expert ``e`` (one or many (micro-batch, layer)).
        home: [..., E] home GPU of each expert (same leading axes).
        cost: the cost model; its :meth:`~CostModel.linear` coefficients define the objective.
        replica_slots: ``r``, replica slots per GPU (the layer-shared buffer).
        split: ``"waterfill"`` (compute-only closed form, compiled) or ``"lp"`` (eq. 7 LP per candidate).
        acceptance: which copies the water-filling greedy keeps. ``"comm"``: those that lower the linearised
            ``T_comp_max + T_comm_max``; ``"compute"``: those that lower ``T_comp_max``; ``"best"`` (default):
            both runs, keeping the one with the lower ``T_MoE``, the compute-driven run cut where its
            ``T_MoE`` was lowest (a copy can lower compute yet raise the busiest link, and a later one undo
            that, so neither rule alone is best everywhere).
        sweeps: water-filling sweeps over the node's replicated experts after each new copy.
        max_tries: experts of the bottleneck GPU tried (by decreasing tokens) before the greedy stops.
        rel_tol: minimal relative objective drop for a replica to be kept.
        polish_moves: after the greedy, at most this many improving exchange moves (drop one copy, add
            another in the same node); 0 disables the polish (``"waterfill"`` only).
        polish_candidates: experts tried per rule and dropped copy by the polish.
        overlap: under ``cluster.ep_overlap``, each problem's attention and neighbours (one row per problem,
            in the order of ``load``'s leading axes): the objective becomes the terms of the overlapped layer
            time the problem's micro-batch enters (:func:`relibra.cost.overlap.microbatch_share`) in place of
            ``T_MoE`` (either split). None: ``T_MoE``.

    Returns:
        :class:`Replication` with ``assign`` int32 [..., E, G] and ``replicas`` int32 [..., G, r].
    """
    load = np.asarray(load)
    home = np.asarray(home)
    cluster = cost.cluster
    g_n, gpn = cluster.num_gpus, cluster.domain_gpus
    _check(load, home, g_n, gpn, replica_slots)
    lead = load.shape[:-2]
    e_n = load.shape[-1]
    x = np.ascontiguousarray(load.reshape(-1, g_n, e_n), dtype=np.float64)
    h = np.ascontiguousarray(home.reshape(-1, e_n), dtype=np.int64)
    coef = ReplicationCoefficients.from_cost(cost)
    if polish_moves < 0 or polish_candidates < 1:
        raise ValueError(
            f"polish_moves={polish_moves} must be >= 0 and polish_candidates={polish_candidates} >= 1"
        )
    ov = np.zeros((0, 7))
    if overlap is not None:
        if overlap.attention.shape != (x.shape[0],):
            raise ValueError(
                f"overlap has {overlap.attention.shape[0]} rows; expected one per problem ({x.shape[0]})"
            )
        spt = coef.seconds_per_token
        ov = np.empty((x.shape[0], 7))
        ov[:, 0] = overlap.attention / spt
        ov[:, 1] = coef.latency
        ov[:, 2:6] = overlap.neighbours / spt
        ov[:, 6] = overlap.contention
    if split == "lp":
        # NOTE: imported on use, so that the default waterfill split never loads OR-Tools.
        from relibra.planners.replicate.milp import greedy_with_lp_split

        assign, replicas = greedy_with_lp_split(
            x, h, cost, replica_slots, max_tries=max_tries, rel_tol=rel_tol, overlap=overlap
        )
    elif split == "waterfill":
        if acceptance not in _MODES:
            raise ValueError(f"acceptance must be one of {sorted(_MODES)}, got {acceptance!r}")
        assign, replicas = _greedy_batch(
            x,
            h,
            gpn,
            max(replica_slots, 1),
            coef.fixed_tokens,
            coef.nvlink_per_token,
            coef.nic_per_token,
            _MODES[acceptance],
            sweeps,
            max_tries if replica_slots > 0 else 0,
            rel_tol,
            polish_moves if replica_slots > 0 else 0,
            polish_candidates,
            cost.model.top_k if cost.dispatcher == "deepep" else 0,
            ov,
            coef.dispatch_scale,
        )
        replicas = replicas[..., :replica_slots]
    else:
        raise ValueError(f"split must be 'waterfill' or 'lp', got {split!r}")
    return Replication(
        assign=assign.reshape(*lead, e_n, g_n).astype(np.int32),
        replicas=replicas.reshape(*lead, g_n, replica_slots).astype(np.int32),
    )


def linear_objective(load: np.ndarray, assign: np.ndarray, home: np.ndarray, cost: CostModel) -> np.ndarray:
    """Linearised ``T_MoE`` in seconds, the objective both the greedy and the MILP minimise.

    load [..., G, E], assign [..., E, G], home [..., E] -> float64 [...]. Every expert is charged its fixed
    cost at home (``z = 1`` there) and on every other GPU where it has tokens; communication follows the
    proportional split rule exactly.
    """
    coef = ReplicationCoefficients.from_cost(cost)
    g_n = cost.cluster.num_gpus
    a = np.asarray(assign, dtype=np.float64)
    at_home = np.arange(g_n) == np.asarray(home)[..., None]  # [..., E, G]
    copies = (a > 0) | at_home
    comp = a.sum(axis=-2) + coef.fixed_tokens * copies.sum(axis=-2)  # [..., G]
    # the cost model's own communication term, by its dispatcher (alltoall: piecewise linear in the traffic)
    comm_s = cost.moe_comm_time(load, assign)  # [..., G]
    return comp.max(axis=-1) * coef.seconds_per_token + comm_s.max(axis=-1)


@dataclass(frozen=True)
class GreedyReplicator:
    """:class:`~relibra.planners.protocols.Replicator` running :func:`replicate_greedy` over a micro-batch's
    layers, with ``replica_slots`` (``r``) slots per GPU and ``config`` (default: :class:`GreedyConfig`'s)."""

    replica_slots: int
    config: GreedyConfig = GreedyConfig()

    @property
    def refill_aware(self) -> bool:
        return self.config.refill_aware

    def with_slots(self, replica_slots: int) -> GreedyReplicator:
        return replace(self, replica_slots=replica_slots)

    def replicate(
        self,
        load: np.ndarray,
        home: np.ndarray,
        ctx: BatchContext,
        overlap: OverlapNeighbours | None = None,
    ) -> Replication:
        """load [L, G, E], home [L, E] -> Replication with assign [L, E, G], replicas [L, G, r]; ``overlap``
        (one row per layer): the overlapped objective (:func:`replicate_greedy`)."""
        c = self.config
        return replicate_greedy(
            load,
            home,
            ctx.cost,
            self.replica_slots,
            split=c.split,
            acceptance=c.acceptance,
            sweeps=c.sweeps,
            max_tries=c.max_tries,
            polish_moves=c.polish_moves,
            polish_candidates=c.polish_candidates,
            overlap=overlap,
        )
