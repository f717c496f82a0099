"""What a re-homed expert carries when reordering moves it, how it arrives, and what that costs
(docs/spine.md, "Cost model" and "Migration").

**Payload.** Reordering happens between two optimizer steps (one RL training step per batch), so a moved
expert carries its weights and its optimizer state and no gradient (gradients are zero between steps).
Under Megatron-LM's mixed precision with Adam (``--bf16``, the default
``--use-precision-aware-optimizer=False``) that is, per parameter: the bf16 weight (2 bytes), the fp32 master
weight (4) and Adam's two fp32 moments ``exp_avg`` and ``exp_avg_sq`` (8). With Megatron's distributed
optimizer (``--use-distributed-optimizer``) the master weights and the moments of the expert parameters are
sharded over the expert-data-parallel group of size ``d`` (:func:`relibra.parallel.expert_data_parallel`,
from ``parallel.dp``), so each destination GPU receives the whole bf16 weight and ``1 / d`` of the state:
``2 + 12 / d`` bytes per parameter (14 at ``d = 1``).

**Path** (``simulator.migration.path``):

* ``network``: the old home sends the payload to the new home over NVLink (same node) or the rail NIC
  (other node), all moves at once (:meth:`relibra.cost.model.CostModel.transfer_time`). This is every
  trainer that keeps its training state on the GPUs between steps (Megatron-LM, NeMo-RL and verl without
  offload, non-colocated ``slime``).
* ``reload``: colocated RL trainers put the training weights and optimizer state in host memory while the
  rollout engine holds the GPUs and load them back before training (verl's Megatron workers with
  ``param_offload`` / ``optimizer_offload``, ``verl/utils/megatron_utils.py: offload_megatron_optimizer``,
  ``load_megatron_optimizer``; slime's colocated mode through ``torch_memory_saver``; NeMo-RL colocated,
  ``offload_before_refit`` / ``offload_after_refit`` and the optimizer moved back before training). A new
  home in the same node can load the expert from the node's host memory in place of the old home, at no
  cost beyond the reload that happens anyway; a move to another node sends its payload over the network
  and through the destination's host link, alongside the reload: its charge is the larger of its network
  time and its bytes over the host-to-device rate (``cluster.hardware.host_to_device_bytes_per_s``). The
  reload itself is the same for every placement and is not charged. NOTE: the trainers above each reload
  their own rank's host buffer; loading another rank's buffer needs that buffer shared within the node
  (pinned shared memory), a change to the trainer this path assumes.

**Window** (``simulator.migration.window_s``): seconds of the post-rollout window (the reference and
old-policy log-probability passes, which a trainer runs after rollout and before the update, and which the
planner already hides behind) that the moves may overlap; only the part of the migration beyond it is
charged. The default 0 charges every move: the log-probability passes run the same EP all-to-all on the
same links, and holding the old and the new copy of every moved expert at once needs HBM the memory plan
does not give. Set it to the window a run measures (verl logs ``timing_s/old_log_prob`` and
``timing_s/ref``) where the fabric is idle in that window.

:class:`MigrationPayload` holds the one default of every field; ``simulator.migration.*`` overrides them
(``null`` keeps the default) and ``parallel.dp`` sets ``expert_data_parallel``
(:func:`migration_payload`). The cost model carries the payload (``CostModel.migration``), so the simulator
and every planner's objective price a move alike (:func:`migration_cost`, :func:`receive_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec

__all__ = [
    "DEFAULT_BYTES_PER_PARAM",
    "MIGRATION_PATHS",
    "MigrationCharge",
    "MigrationPayload",
    "migration_cost",
    "migration_moves",
    "migration_payload",
    "payload_seconds",
    "receive_seconds",
]

MIGRATION_PATHS = ("network", "reload")
"""How a moved expert's bytes arrive (glossary: migration path)."""


class CostModel(Protocol):
    """What the migration charge reads of :class:`relibra.cost.model.CostModel` (a Protocol, so this module
    does not import the cost model, which imports it)."""

    cluster: ClusterSpec
    model: ModelSpec
    migration: MigrationPayload

    def transfer_time(self, src: np.ndarray, dst: np.ndarray, bytes_each: float) -> float: ...


@dataclass(frozen=True)
class MigrationPayload:
    """Bytes per parameter a re-homed expert carries, by part, and how they arrive."""

    weight_bytes: float = 2.0
    """The model copy of the weight (bf16: 2; fp8 weights: 1)."""
    master_weight_bytes: float = 4.0
    """The optimizer's master weight (fp32: 4; 0 without a separate master copy)."""
    optimizer_state_bytes: float = 8.0
    """Optimizer state per parameter (Adam's two fp32 moments: 8; bf16 moments: 4)."""
    expert_data_parallel: int = 1
    """``d``: ranks of the expert-data-parallel group the distributed optimizer shards the master weights and
    the optimizer state over; derived from ``parallel.dp`` (:func:`relibra.parallel.expert_data_parallel`)."""
    path: str = "network"
    """``network`` or ``reload`` (module docstring)."""
    window_s: float = 0.0
    """Seconds of the post-rollout window the moves may overlap (module docstring); 0: none."""
    host_to_device_bytes_per_s: float = 0.0
    """The destination's host link (``reload`` only), from ``cluster.hardware``; 0: unknown."""

    def __post_init__(self) -> None:
        for key in ("weight_bytes", "master_weight_bytes", "optimizer_state_bytes"):
            value = getattr(self, key)
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if not (numeric and math.isfinite(value) and value >= 0):
                raise ValueError(f"simulator.migration.{key}={value}: expected a finite number >= 0")
        d = self.expert_data_parallel
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(
                f"parallel.dp: the expert-data-parallel size it gives is {d}; expected an integer >= 1"
            )
        if self.path not in MIGRATION_PATHS:
            raise ValueError(
                f"simulator.migration.path={self.path}: unknown migration path; expected one of "
                f"{', '.join(MIGRATION_PATHS)}"
            )
        w = self.window_s
        if isinstance(w, bool) or not (isinstance(w, int | float) and math.isfinite(w) and w >= 0):
            raise ValueError(
                f"simulator.migration.window_s={w}: expected a finite number of seconds >= 0 (the "
                "post-rollout window the moves may overlap)"
            )
        rate = self.host_to_device_bytes_per_s
        if not (math.isfinite(rate) and rate >= 0):
            raise ValueError(
                f"cluster.hardware.host_to_device_bytes_per_s={rate}: expected a finite rate >= 0"
            )
        if self.path == "reload" and rate <= 0:
            raise ValueError(
                "simulator.migration.path=reload needs cluster.hardware.host_to_device_bytes_per_s > 0 (the "
                "host-to-device rate of the reload); the cluster yaml gives none"
            )

    @property
    def bytes_per_param(self) -> float:
        """Bytes each destination GPU receives per parameter of a re-homed expert (default ``2 + 12 / d``)."""
        state = self.master_weight_bytes + self.optimizer_state_bytes
        return self.weight_bytes + state / self.expert_data_parallel


@dataclass(frozen=True)
class MigrationCharge:
    """What re-homing a batch's moved experts costs."""

    moved: int
    """(layer, expert) pairs whose home changed."""
    network_bytes: float
    """Bytes the EP group sends between GPUs (``reload``: only the moves across nodes)."""
    seconds: float
    """The moves' transfer time (the busiest GPU bounds it)."""
    exposed_s: float
    """``max(0, seconds - window_s)``: the part charged to the batch."""


def migration_moves(prev_home: np.ndarray, home: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 [N] each: the old and the new home of every (layer, expert) whose home changed from
    ``prev_home`` to ``home`` (int [L, E] each), in row-major (layer, expert) order."""
    moved_l, moved_e = np.nonzero(np.asarray(home) != np.asarray(prev_home))
    src = np.asarray(prev_home)[moved_l, moved_e].astype(np.int64)
    dst = np.asarray(home)[moved_l, moved_e].astype(np.int64)
    return src, dst


def payload_seconds(
    cost: CostModel, src: np.ndarray, dst: np.ndarray, bytes_each: float
) -> tuple[float, int]:
    """Seconds to move one payload of ``bytes_each`` from ``src[i]`` to ``dst[i]`` (int64 [N] each) for every
    ``i`` at once along ``cost.migration.path``, and how many of the moves cross the network (``reload``:
    those across nodes; ``network``: all)."""
    pay = cost.migration
    if pay.path == "reload":
        gpn = cost.cluster.gpus_per_node
        cross = src // gpn != dst // gpn
        src, dst = src[cross], dst[cross]
        received = np.bincount(dst, minlength=cost.cluster.num_gpus) * bytes_each
        pcie = float(received.max()) / pay.host_to_device_bytes_per_s if dst.size else 0.0
        seconds = max(cost.transfer_time(src, dst, bytes_each), pcie)
    else:
        seconds = cost.transfer_time(src, dst, bytes_each)
    return float(seconds), int(src.size)


def migration_cost(cost: CostModel, prev_home: np.ndarray, home: np.ndarray) -> MigrationCharge:
    """The charge of moving from ``prev_home`` to ``home`` (int [L, E] each) with ``cost.migration``."""
    pay = cost.migration
    src, dst = migration_moves(prev_home, home)
    expert_bytes = cost.model.expert_params * pay.bytes_per_param
    seconds, network_moves = payload_seconds(cost, src, dst, expert_bytes)
    return MigrationCharge(
        moved=int(src.size),
        network_bytes=float(network_moves * expert_bytes),
        seconds=seconds,
        exposed_s=max(0.0, seconds - pay.window_s),
    )


def receive_seconds(cost: CostModel, prev_home: np.ndarray) -> np.ndarray:
    """float64 [E, G]: seconds for GPU ``g`` to receive expert ``e`` from its home ``prev_home`` [E] alone, by
    ``cost.migration`` (0 where ``g`` is the home; ``reload``: 0 within the home's node).

    The planners' per-expert form of :func:`migration_cost`: one expert's payload over the destination's
    NVLink (same NVLink domain, ``cluster.nvl_domain``) or rail NIC (other domain; ``reload``: 0 in the
    node, else the NIC or the host link, whichever is slower), at the
    cost model's achievable rates. The window is not subtracted (a per-expert charge cannot know what the
    other moves leave of it), so a planner charging this never under-prices a move.
    """
    pay = cost.migration
    prev = np.asarray(prev_home, dtype=np.int64)
    g = cost.cluster.num_gpus
    gpn = cost.cluster.gpus_per_node
    nbytes = cost.model.expert_params * pay.bytes_per_param
    hw = cost.cluster.hardware
    nvlink = nbytes / (hw.nvlink_bytes_per_s * hw.nvlink_efficiency)
    nic = nbytes / (hw.nic_bytes_per_s * hw.nic_efficiency)
    gpus = np.arange(g)
    if pay.path == "reload":
        # NOTE: the reload is free inside the host (the node), whatever the NVLink domain.
        same_node = (prev[:, None] // gpn) == (gpus[None, :] // gpn)
        nic = max(nic, nbytes / pay.host_to_device_bytes_per_s)
        out = np.where(same_node, 0.0, nic)
    else:
        dom = cost.cluster.domain_gpus
        same_domain = (prev[:, None] // dom) == (gpus[None, :] // dom)
        out = np.where(same_domain, nvlink, nic)
    out[prev[:, None] == gpus[None, :]] = 0.0
    return np.asarray(out, dtype=np.float64)


def migration_payload(
    overrides: Mapping[str, Any] | None = None,
    *,
    expert_data_parallel: int = 1,
    host_to_device_bytes_per_s: float = 0.0,
) -> MigrationPayload:
    """The payload with ``overrides`` (the ``simulator.migration`` config node) applied, a ``None`` value
    keeping the field's default; ``expert_data_parallel`` from the parallel dimensions and the host link's
    rate from the cluster's hardware."""
    given = {k: v for k, v in dict(overrides or {}).items() if v is not None}
    settable = {"weight_bytes", "master_weight_bytes", "optimizer_state_bytes", "path", "window_s"}
    unknown = sorted(set(given) - settable)
    if unknown:
        raise ValueError(
            f"simulator.migration: unknown keys {unknown}; expected {', '.join(sorted(settable))} (the "
            "expert-data-parallel size comes from parallel.dp)"
        )
    return MigrationPayload(
        **given,
        expert_data_parallel=expert_data_parallel,
        host_to_device_bytes_per_s=host_to_device_bytes_per_s,
    )


DEFAULT_BYTES_PER_PARAM = MigrationPayload().bytes_per_param
"""14.0: bf16 weight, fp32 master weight, two fp32 Adam moments; no gradient, ``d = 1``."""
