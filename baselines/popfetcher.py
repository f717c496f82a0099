"""PopFetcher: popularity-based expert-wise prefetch (Zhang et al., USENIX ATC 2025).

Source: the paper ("PopFetcher: Towards Accelerated Mixture-of-Experts Training Via Popularity Based
Expert-Wise Prefetch"); no public code exists, so this module implements the published mechanism:

1. **Popularity prediction** from a sliding window of the last ``window`` (paper: 10) iterations combined
   with the correlation between adjacent layers' expert choices: for layer ``l`` of micro-batch ``m``,
   ``pred = beta * (x[m, l-1, j, :] @ T_l) + (1 - beta) * popularity_l[j, :]``, where ``x[m, l-1]`` is the
   current micro-batch's routing at the previous layer (known when layer ``l``'s attention runs),
   ``T_l[e, e']`` the window's row-normalised co-occurrence of expert ``e`` at layer ``l-1`` and ``e'``
   at layer ``l``, and ``popularity_l`` the window's mean load of each source GPU; both terms are scaled
   to the GPU's routed slots in this micro-batch. Layer 0 uses the window term only.
2. **Prefetch during the preceding non-MoE computation**: each GPU pulls the weights of the non-home
   experts it is predicted to send the most tokens to, into its ``replica_slots`` prefetch buffer, when
   the tokens outweigh the parameters (``tokens * 4 phases * hidden * 2 B > pull_ratio * 2 * expert
   bytes``: dispatch and combine, forward and backward, against weights in and gradients back);
   otherwise its tokens are pushed by the usual all-to-all. A prefetched expert serves the GPU's own
   tokens for it locally (``assign[e, g] = x[m, l, g, e]``), the rest stay at home.
3. The prefetch buffer is ``BatchPlan.replicas [Mb, L, G, r]``, so the simulator charges the transfer and
   the gradient return like ReLibra's refill. Prefetched copies come from the expert's home on any node.

Open choices (the paper leaves them open; see docs/baselines.md): an *iteration* of the window is one
micro-batch; the window holds the latest micro-batches of earlier batches (``ctx.history``) followed by
this batch's earlier micro-batches (never the one being planned); the suite's traces reduce to per-sample
counts, so ``T_l`` is estimated from per-(micro-batch, source GPU) loads rather than per-token routes;
``beta = correlation_weight``; the paper's MILP over prefetch choices is replaced by its pruning rule
(candidates ranked by predicted tokens, at most ``r`` per GPU, only those that pass the pull test).
Placement is Megatron-LM's static one. Predictions can be wrong: ``stats["prediction_hit_rate"]`` is the
mean overlap of the predicted and the actual top-``popular_experts`` experts per (micro-batch, layer), and
``stats["prefetch_useful_rate"]`` the fraction of prefetched copies whose actual tokens pass the pull test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from relibra.cost.model import BF16_BYTES
from relibra.planners.protocols import BatchContext, SlotBudget, home_assign, static_placement
from relibra.types import BatchPlan

__all__ = ["PopFetcherPlanner", "adjacent_layer_transition", "pull_threshold"]


def adjacent_layer_transition(window: np.ndarray) -> np.ndarray:
    """Row-normalised co-occurrence of adjacent layers' experts over a window of loads.

    window [W, L, G, E] -> T float64 [L, E, E] with ``T[l, e, e']`` the share of layer ``l``'s routing
    that goes to ``e'`` on GPUs (and micro-batches) that sent to ``e`` at layer ``l - 1``; ``T[0]`` is 0.
    """
    x = np.asarray(window, dtype=np.float64)
    w, num_layers, g, num_experts = x.shape
    prev = x[:, :-1].transpose(1, 0, 2, 3).reshape(num_layers - 1, w * g, num_experts)
    cur = x[:, 1:].transpose(1, 0, 2, 3).reshape(num_layers - 1, w * g, num_experts)
    co = _cooccurrence(prev, cur)
    rows = co.sum(-1, keepdims=True)
    out = np.zeros((num_layers, num_experts, num_experts))
    out[1:] = np.divide(co, rows, out=np.zeros_like(co), where=rows > 0)
    return out


def _cooccurrence(prev: np.ndarray, cur: np.ndarray) -> np.ndarray:
    """``co[l, e, f] = sum_s prev[l, s, e] * cur[l, s, f]`` for [L, S, E] loads.

    Whole-number loads (token counts, as the window's are) make every product and partial sum an integer
    below ``2**53`` (checked), which float64 holds exactly: then BLAS's batched matmul, whatever its order
    and host, gives the numbers of einsum's unoptimised sequential sum, in a fraction of its time. Other loads
    keep einsum's sum.
    """
    whole = np.array_equal(prev, np.rint(prev)) and np.array_equal(cur, np.rint(cur))
    if whole and prev.size and cur.size:
        bound = float(np.abs(prev).sum(axis=1).max()) * float(np.abs(cur).max())  # >= |every partial sum|
        whole = bound < 2.0**53
    if whole:
        return np.matmul(prev.transpose(0, 2, 1), cur)
    return np.einsum("lse,lsf->lef", prev, cur)


def pull_threshold(hidden: int, expert_bytes: float, pull_ratio: float) -> float:
    """Tokens above which pulling an expert's weights beats pushing its tokens.

    Tokens cross the link four times (dispatch and combine, forward and backward) at ``hidden`` bf16
    values each; a pulled expert moves its weights in and its gradient back.
    """
    return pull_ratio * 2.0 * expert_bytes / (4.0 * hidden * BF16_BYTES)


def _scale_rows(x: np.ndarray, total: np.ndarray) -> np.ndarray:
    """Rescale the last axis of x [..., E] to sum to total [...] (zero rows stay zero)."""
    s = x.sum(-1, keepdims=True)
    return np.divide(x * total[..., None], s, out=np.zeros_like(x), where=s > 0)


def _top_k_overlap(pred: np.ndarray, actual: np.ndarray, k: int) -> np.ndarray:
    """|top-k(pred) ∩ top-k(actual)| / k along the last axis. [..., E] -> [...]."""
    top_p = np.argsort(-pred, axis=-1, kind="stable")[..., :k]
    top_a = np.argsort(-actual, axis=-1, kind="stable")[..., :k]
    return (top_p[..., :, None] == top_a[..., None, :]).any(-1).sum(-1) / k


@dataclass(frozen=True)
class PopFetcherPlanner:
    """PopFetcher as a :class:`~relibra.planners.protocols.Planner`: static placement plus predicted
    prefetches.

    ``replica_slots`` (r) prefetch buffer slots per GPU per layer; ``window`` iterations (micro-batches)
    in the sliding window; ``correlation_weight`` the weight of the adjacent-layer term; ``pull_ratio``
    scales the pull test; ``popular_experts`` K of the hit rate (0: the model's top-k).
    """

    name: str = "popfetcher"
    replica_slots: int = 2
    redundant_slots: int = 0
    window: int = 10
    correlation_weight: float = 0.5
    pull_ratio: float = 1.0
    popular_experts: int = 0

    def __post_init__(self) -> None:
        if self.replica_slots < 0:
            raise ValueError(f"planner.replica_slots={self.replica_slots}; need >= 0")
        if self.redundant_slots != 0:
            raise ValueError(
                f"planner.redundant_slots={self.redundant_slots}: PopFetcher has no permanent slots; use 0"
            )
        if self.window < 1:
            raise ValueError(f"planner.window={self.window}; need >= 1 iteration")
        if not 0.0 <= self.correlation_weight <= 1.0:
            raise ValueError(f"planner.correlation_weight={self.correlation_weight}; need a value in [0, 1]")
        if self.pull_ratio <= 0.0:
            raise ValueError(f"planner.pull_ratio={self.pull_ratio}; need > 0")

    replicas_in_home_node = False
    """Prefetched copies come from the expert's home on any node."""

    @property
    def slot_budget(self) -> SlotBudget:
        return SlotBudget(self.replica_slots, self.redundant_slots, self.replicas_in_home_node)

    @property
    def history_batches(self) -> int:
        """Batches of past loads it may read: ``window`` (the window counts micro-batches and a batch holds at
        least one, so ``window`` batches always fill it)."""
        return self.window

    def predict(self, window: np.ndarray, current: np.ndarray) -> np.ndarray:
        """Predicted loads of one micro-batch.

        window [W, L, G, E] loads of the window's iterations (W >= 1); current [L, G, E] the micro-batch's
        actual loads, of which layer ``l`` only reads layer ``l - 1`` (and layer 0 its slot count).
        -> float64 [L, G, E].
        """
        slots = np.asarray(current, dtype=np.float64).sum(-1)  # [L, G]: routed slots per GPU and layer
        popularity = _scale_rows(np.asarray(window, dtype=np.float64).mean(0), slots)  # [L, G, E]
        trans = adjacent_layer_transition(window)  # [L, E, E]
        pred = popularity.copy()
        corr = np.einsum("lge,lef->lgf", np.asarray(current[:-1], dtype=np.float64), trans[1:])
        corr = _scale_rows(corr, slots[1:])
        beta = self.correlation_weight
        pred[1:] = beta * corr + (1.0 - beta) * popularity[1:]
        return pred

    def _window(self, ctx: BatchContext, m: int) -> np.ndarray:
        """The last ``window`` micro-batch loads before micro-batch ``m``: [W, L, G, E] (W may be 0)."""
        parts = [np.asarray(h) for h in ctx.history if np.asarray(h).shape[1:] == ctx.load.shape[1:]]
        parts.append(np.asarray(ctx.load[:m]))
        return np.concatenate(parts, axis=0)[-self.window :]

    def plan(self, ctx: BatchContext) -> BatchPlan:
        """ctx.load [Mb, L, G, E] -> BatchPlan with replicas [Mb, L, G, r] and assign [Mb, L, E, G]."""
        t0 = time.perf_counter()
        mb, num_layers, g, num_experts = ctx.load.shape
        r = self.replica_slots
        home = static_placement(num_layers, num_experts, g)
        assign = home_assign(ctx.load, home, g).astype(np.int64)  # [Mb, L, E, G]
        replicas = np.full((mb, num_layers, g, r), -1, dtype=np.int32)
        threshold = pull_threshold(ctx.model.hidden, ctx.cost.expert_weight_bytes(), self.pull_ratio)
        is_home = home[:, None, :] == np.arange(g)[None, :, None]  # [L, G, E]
        k = self.popular_experts or ctx.model.top_k
        hits, useful, fetched = [], 0, 0
        for m in range(mb):
            window = self._window(ctx, m)
            if window.shape[0] == 0 or r == 0:
                continue
            actual = np.asarray(ctx.load[m])  # [L, G, E]
            pred = self.predict(window, actual)
            hits.append(_top_k_overlap(pred.sum(1), actual.sum(1), min(k, num_experts)))
            score = np.where(is_home | (pred <= threshold), -np.inf, pred)  # [L, G, E]
            top = np.argsort(-score, axis=-1, kind="stable")[..., :r]  # [L, G, r]
            chosen = np.isfinite(np.take_along_axis(score, top, -1))
            replicas[m] = np.where(chosen, top, -1)
            l_idx, g_idx, slot = np.nonzero(chosen)
            e_idx = top[l_idx, g_idx, slot]
            local = actual[l_idx, g_idx, e_idx].astype(np.int64)
            # NOTE: several GPUs may fetch one expert, so the home's share is reduced with unbuffered ops.
            np.subtract.at(assign[m], (l_idx, e_idx, home[l_idx, e_idx]), local)
            np.add.at(assign[m], (l_idx, e_idx, g_idx), local)
            useful += int((local > threshold).sum())
            fetched += len(e_idx)
        plan_time = time.perf_counter() - t0

        stats = {
            "prediction_hit_rate": float(np.mean(hits)) if hits else 0.0,
            "prefetch_useful_rate": useful / fetched if fetched else 0.0,
            "prefetched_experts": float(fetched),
            "prefetch_cross_node_copies": float(self._cross_node(replicas, home, ctx.cluster.domain_gpus)),
            "pull_threshold_tokens": float(threshold),
            "reorder_moved_experts": 0.0,
        }
        return BatchPlan(
            home=home,
            assign=assign.astype(np.int32),
            load=ctx.load,
            sample_gpu=ctx.sample_gpu,
            replicas=replicas,
            plan_time_s=plan_time,
            stats=stats,
        )

    @staticmethod
    def _cross_node(replicas: np.ndarray, home: np.ndarray, gpus_per_node: int) -> int:
        """Prefetched copies whose home is on another node. replicas [Mb, L, G, r], home [L, E]."""
        m, l, g, s = np.nonzero(replicas >= 0)
        src = home[l, replicas[m, l, g, s]]
        return int((src // gpus_per_node != g // gpus_per_node).sum())
