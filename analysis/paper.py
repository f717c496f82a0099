"""The paper's reported numbers (ReLibra, arXiv 2605.08639), as data.

Ranges are ``(low, high)`` over the paper's models and datasets. Planner names follow the run config's
``planner`` group; model and dataset names follow ``conf/model`` and the workload's dataset names.
"""

from __future__ import annotations

from typing import Final

from relibra.planners import registry

OVERALL_SPEEDUP: Final[dict[str, tuple[float, float]]] = {
    "megatron": (1.21, 1.58),
    "popfetcher": (1.17, 1.27),
    "eplb": (1.06, 1.21),
    "lplb": (1.06, 1.21),
}
"""ReLibra's training throughput over each baseline (x)."""

FRACTION_OF_BALANCED: Final[tuple[float, float]] = (0.90, 0.94)
"""ReLibra's throughput as a fraction of the Balanced ideal bound."""

ABLATION: Final[dict[tuple[str, str], float]] = {
    ("relibra_reorder_only", "reasoning"): 1.12,
    ("relibra_reorder_only", "mixed"): 1.15,
    ("relibra", "reasoning"): 1.46,
    ("relibra", "mixed"): 1.39,
}
"""Throughput relative to Megatron-LM: ``(variant, dataset) -> x``. ``relibra`` is reordering plus
intra-batch replication (the paper's "+ intra-batch replication" row)."""

SKEW_BY_EP: Final[dict[str, tuple[float, float]]] = {"relibra": (1.00, 1.08)}
"""Skewness range across EP 8-64 (Qwen3-30B-A3B). Megatron-LM's grows with EP size (no number given)."""

SKEW_BY_DATASET: Final[dict[str, tuple[float, float]]] = {"relibra": (1.02, 1.07)}
"""Skewness range across datasets (Qwen3-235B-A22B)."""

REPLICA_BUFFER: Final[dict[str, tuple[float, float]]] = {
    "qwen3-30b-a3b": (18.0, 0.28),
    "glm4.5-106b-a12b": (22.0, 0.13),
    "qwen3-235b-a22b": (72.0, 1.62),
}
"""Replica buffer per GPU: ``model -> (MiB, percent of the GPU's parameter bytes)``."""

REORDER_OVERHEAD_PCT: Final[tuple[float, float]] = (1.4, 2.1)
"""Reordering overhead as a percentage of batch time."""

ULTRAEP_HEADLINE: Final[dict[str, float]] = {"of_force_balanced": 0.946, "over_megatron": 1.42}
"""UltraEP's own training headline at EP 64 (arXiv 2606.04101): 94.6 % of force-balanced throughput on
average and +42 % over Megatron-LM. Not ReLibra's paper: the anchor of the UltraEP side-by-side table."""

ULTRAEP_HEADLINE_MODELS: Final[tuple[str, ...]] = ("qwen3-235b-a22b", "glm4.5-106b-a12b")
"""The suite's models closest to UltraEP's training evaluation (both run at EP 64 in the presets)."""

TESTBED: Final[str] = (
    "20 nodes x 8 Hopper GPUs, 8 x 400 Gb/s rail-optimized InfiniBand per node, 900 GB/s NVLink"
)


def label(planner: str) -> str:
    """The display name of ``planner``: its planner card's label (the paper's name where it has one;
    :mod:`relibra.planners.registry`), the name itself for a planner no card holds."""
    return registry.label(planner)
