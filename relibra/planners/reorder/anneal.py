"""ReLibra's inter-batch expert reordering: swap-based simulated annealing over placements.

Once per batch and per MoE layer, choose the home GPU of every expert (``E / G`` experts per GPU) so that
the batch's MoE time under the cost model is small (paper, section "inter-batch reordering"):

1. **Objective.** The cost model's ``T_MoE = max_g T_comp(g) + max_g T_comm(g)`` with every expert computed
   at home, using the linearised coefficients of :meth:`CostModel.linear` for compute (seconds per token plus
   a fixed cost per non-empty expert) and the exact rail-optimized link routing of
   :meth:`CostModel.link_bytes` for communication (``cluster.dispatcher=alltoall``). With
   ``dispatcher=deepep`` the communication term is the cost model's DeepEP estimate
   (:func:`relibra.cost.fabric.deepep_link_tokens_estimate`): the search keeps, per (micro-batch, source), the
   probability that a token misses each GPU and each node, which a swap scales by one factor per source
   (O(Mb * G) per swap, as for alltoall). ``objective="microbatch"`` (the default) sums ``T_MoE``
   over the batch's ``Mb`` micro-batches, which is what the simulator charges; ``objective="aggregate"``
   evaluates one ``T_MoE`` on the batch's summed loads. The paper's O(G)-per-swap update is the aggregate
   form; the per-micro-batch form costs O(Mb * G) per swap. Under ``cluster.ep_overlap`` (read from the
   cost model) a layer's objective is its overlapped time over the micro-batches
   (:func:`relibra.cost.overlap.layer_time`, the simulator's rule), each micro-batch's compute maximum plus
   its attention against its communication maximum; O(Mb) more per evaluation (docs/reorder.md).
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

import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from relibra.cost.model import CostModel
from relibra.cost.pricing import attention_window
from relibra.planners.protocols import BatchContext, Reordering, static_placement
from relibra.planners.reorder.config import AnnealConfig, main_iterations
from relibra.planners.reorder.kernels import anneal_layer, placement_objective
from relibra.planners.reorder.links import link_routes
from relibra.planners.reorder.locality import locality_round
from relibra.planners.reorder.problem import layer_problem, lpt_placement

__all__ = ["AnnealingReorderer", "solve_layer"]


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
    attention: np.ndarray | None = None
    """[Mb'] attention seconds per row (read under ``cluster.ep_overlap``)."""
    microbatches: int | None = None
    """Micro-batches the rows stand for (the batch's, for the aggregate objective)."""


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
    attention: np.ndarray | None = None,
    microbatches: int | None = None,
) -> tuple[np.ndarray, float, float]:
    """One layer, every seed, as :class:`AnnealingReorderer` runs it.

    Args:
        load_l: [Mb, G, E] loads whose summed ``T_MoE`` is the objective (one row for the aggregate form);
            under ``cluster.ep_overlap`` their overlapped layer time (:func:`layer_problem`).
        start: [E] start placement (default: LPT on the experts' compute); prev_home: [E] or None.
        layer: mixes into each seed's stream; seeds: default ``config.seeds``.
        attention: [Mb] seconds per row and microbatches: the micro-batches the rows stand for, both only
            read under ``cluster.ep_overlap`` (:func:`layer_problem`).
    Returns:
        (best home int32 [E], its true objective in seconds, the LPT / given start's objective in seconds).
    """
    cfg = config
    routes = routes if routes is not None else link_routes(cost.cluster.num_domains, cost.cluster.domain_gpus)
    g = cost.cluster.num_gpus
    problem = layer_problem(
        load_l,
        cost,
        prev_home=prev_home,
        migration_weight=cfg.migration_weight,
        compute_level=cfg.compute_level,
        comm_weight=cfg.comm_weight,
        attention=attention,
        microbatches=microbatches,
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
            attention=None if attention is None else np.asarray(attention).sum(keepdims=True),
            microbatches=problem.overlap_mbs or None,
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
    routes = link_routes(task.cost.cluster.num_domains, task.cost.cluster.domain_gpus)
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
            attention=task.attention,
            microbatches=task.microbatches,
        )
        for i, layer in enumerate(task.layers)
    ]


class AnnealingReorderer:
    """ReLibra's reorderer (implements :class:`relibra.planners.protocols.Reorderer`), with ``config``
    (default: :class:`AnnealConfig`'s defaults)."""

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
        mbs = load.shape[0]
        # NOTE: attention is the same for every placement, but the overlap hides communication behind it.
        attention = attention_window(ctx, ctx.sample_gpu) if ctx.cost.cluster.ep_overlap else None  # [Mb]
        if cfg.objective == "aggregate":
            load = load.sum(axis=0, keepdims=True, dtype=np.int64)
            attention = None if attention is None else attention.sum(keepdims=True)
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
                attention=attention,
                microbatches=mbs,
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
        ``locality_*`` stats of :func:`relibra.planners.reorder.locality.locality_round`); the input
        assignment and no stats when ``locality`` is off.
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
