"""The annealer's settings (:class:`AnnealConfig`): the only place their defaults live; the Hydra node
``planner/reorder/anneal`` is generated from it (:mod:`experiments.config.planner_nodes`)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AnnealConfig:
    """Parameters of :class:`AnnealingReorderer`. These defaults are the only ones: the Hydra node
    ``planner/reorder/anneal`` is generated from them (:mod:`experiments.config.planner_nodes`)."""

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
    start: str = "lpt"
    """Where each layer's search starts. ``lpt``: the LPT placement of the batch's loads (the paper; with a
    ``horizon``, the placement in force instead where it is better by the objective). ``previous``: the
    placement in force (``ctx.prev_home``; Megatron-LM's static one on the first batch), the incremental
    reordering: every seed starts there, so a layer whose best new placement does not pay for its moves
    keeps it."""
    horizon: float | None = None
    """Amortisation horizon in batches: the objective adds ``1 / horizon`` times the seconds to receive the
    experts a placement moves (:func:`relibra.cost.migration.receive_seconds`, priced with the simulator's
    payload), so a move must save its migration over ``horizon`` batches. None: moves are free (the paper).
    The recommended configuration's value is measured (docs/reorder.md, "Incremental reordering")."""
    locality: bool = False
    """Run the second round (sample re-assignment for data locality,
    :mod:`relibra.planners.reorder.locality`)."""
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
    ``T_MoE`` for balance wherever the all-to-all dominates (docs/records/replicate.md, "Balance")."""
    compute_level: str = "gpu"
    """Compute term of the objective. ``gpu``: the per-GPU max (what the placement alone runs). ``node``: the
    per-node max of ``node compute / gpus_per_node``, the per-GPU compute after perfect intra-node balancing
    by replicas; for a reordering that intra-node replication follows (see the module docstring, 5.)."""

    def __post_init__(self) -> None:
        # NOTE: Hydra hands a list (or one int); a tuple keeps the config hashable and its repr stable.
        seeds = (self.seeds,) if isinstance(self.seeds, int) else self.seeds
        try:
            object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        except (TypeError, ValueError) as err:
            raise ValueError(f"seeds={self.seeds!r}; expected a list of integers ({err})") from None
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
        if self.start not in ("lpt", "previous"):
            raise ValueError(f"start={self.start!r}; expected 'lpt' or 'previous'")
        if self.horizon is not None and not (
            isinstance(self.horizon, int | float) and math.isfinite(self.horizon) and self.horizon > 0
        ):
            raise ValueError(
                f"horizon={self.horizon}; expected a number of batches > 0 (the amortisation horizon of a "
                "move), or null for free moves"
            )
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

    @property
    def migration_weight(self) -> float:
        """Weight of the migration seconds in the objective: ``1 / horizon`` (0 without a horizon)."""
        return 0.0 if self.horizon is None else 1.0 / self.horizon


def main_iterations(config: AnnealConfig, rows: int, num_gpus: int) -> int:
    """Swap proposals of the main phase for a layer with ``rows`` objective rows on ``num_gpus`` GPUs."""
    if config.iterations is not None:
        return config.iterations
    auto = config.work_per_layer // max(1, rows * num_gpus)
    return int(min(max(auto, config.min_iterations), config.max_iterations))
