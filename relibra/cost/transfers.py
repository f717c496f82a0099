"""The weight transfers of one batch as one schedule, and the one function that prices it (docs/spine.md,
"Transfer schedule").

Every weight movement a plan implies is one :class:`Transfer` of a :class:`TransferSchedule`: what moves
(``kind``), over which links (``path``), from where to where (``slots`` from ``home``, or ``src`` to
``dst``), how many times per update pass (``copies``), whether a recompute pass repeats it, and what it may
overlap (``overlap``). :func:`plan_transfers` derives the schedule from a :class:`~relibra.types.BatchPlan`
(the one place that reads ``replicas``, ``redundant``, ``online`` and ``host_path``); :func:`price_transfers`
prices every transfer into exposed and hidden seconds.

Kinds (:data:`TRANSFER_KINDS`):

* ``replica_fill``: per (micro-batch, layer), the forward fill of the replica slots from each expert's home,
  planned before the batch (ReLibra's layer-shared buffer, PopFetcher's prefetch buffer, ForeMoE's slots);
  it overlaps the layer's forward attention and recurs in a recompute pass.
* ``gradient_return``: the copies' gradients sent home in the backward pass, overlapping the backward
  attention (the planned methods; UltraEP's gradient reduction).
* ``online_copy``: an online planner's copies after routing (UltraEP, LLEP, ECHO): on the critical path,
  ``OnlineCopies.exposed_copies`` times per update pass (the forward copy, and the backward copy or the wait
  for the gradient return), the forward copy again in a recompute pass.
* ``migration``: the payload of every re-homed expert between two steps (:mod:`relibra.cost.migration`),
  overlapping the post-rollout window (``simulator.migration.window_s``).
* ``redundant_sync``: the gradients of the permanent redundant copies (EPLB+, LPLB+) reduced home and the
  updated weights broadcast back, once per step, on the critical path.

Paths (:data:`TRANSFER_PATHS`) choose the link model: ``nvlink`` (the home node's NVLink,
:meth:`CostModel.replica_refill_time`), ``fabric`` (NVLink in the node, the rail NIC across nodes,
:meth:`CostModel.fabric_copy_time`), ``host_engine`` (ForeMoE's transfer engine, the faster of the fabric and
the host link per copy, :meth:`CostModel.engine_copy_time`), ``network`` (one payload per move,
:meth:`CostModel.transfer_time`) and ``migration`` (``cost.migration.path``: the network or the node's host
reload, :func:`relibra.cost.migration.payload_seconds`).

Overlaps (:data:`OVERLAPS`) say what hides a transfer: ``forward_attention`` (a third of the layer's fwd + bwd
attention, backward being twice the forward FLOPs), ``backward_attention`` (the other two thirds),
``post_rollout`` (``cost.migration.window_s`` seconds) and ``none`` (the critical path: all of it exposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from relibra.cost.migration import CostModel as MigrationCost
from relibra.cost.migration import migration_moves, payload_seconds
from relibra.types import BatchPlan

__all__ = [
    "OVERLAPS",
    "TRANSFER_KINDS",
    "TRANSFER_PATHS",
    "Transfer",
    "TransferCharge",
    "TransferSchedule",
    "buffer_transfers",
    "plan_transfers",
    "price_transfers",
    "redundant_transfer",
    "refill_exposed",
    "replicas_per_slot",
    "step_charge",
]

TransferKind = Literal["replica_fill", "gradient_return", "online_copy", "migration", "redundant_sync"]
TransferPath = Literal["nvlink", "fabric", "host_engine", "network", "migration"]
Overlap = Literal["forward_attention", "backward_attention", "post_rollout", "none"]
TRANSFER_KINDS: tuple[TransferKind, ...] = (
    "replica_fill",
    "gradient_return",
    "online_copy",
    "migration",
    "redundant_sync",
)
"""What a transfer moves (module docstring)."""
TRANSFER_PATHS: tuple[TransferPath, ...] = ("nvlink", "fabric", "host_engine", "network", "migration")
"""Which link model prices a transfer (module docstring)."""
OVERLAPS: tuple[Overlap, ...] = ("forward_attention", "backward_attention", "post_rollout", "none")
"""What a transfer may overlap (module docstring)."""
SLOT_PATHS = ("nvlink", "fabric", "host_engine")
"""Paths of the per-(micro-batch, layer) transfers (``slots`` set); the others move ``src`` to ``dst``."""


class CostModel(MigrationCost, Protocol):
    """What the schedule and its pricing read of :class:`relibra.cost.model.CostModel` (a Protocol, so this
    module does not import the cost model)."""

    def expert_weight_bytes(self) -> float: ...

    def replica_refill_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray: ...

    def fabric_copy_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray: ...

    def engine_copy_time(self, replicas: np.ndarray, home: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Transfer:
    """One weight movement of a batch: per (micro-batch, layer) into slots, or per step from ``src`` to
    ``dst``."""

    kind: TransferKind
    """What moves (:data:`TRANSFER_KINDS`)."""
    path: TransferPath
    """The links it takes, which pick its link model (:data:`TRANSFER_PATHS`)."""
    overlap: Overlap
    """What may hide it (:data:`OVERLAPS`); ``none``: the critical path."""
    bytes_each: float
    """Bytes of one expert's payload (the bf16 weights or gradients; a migration's weights and state)."""
    slots: np.ndarray | None = None
    """int32 [Mb, L, G, r] (a planner's one micro-batch: [L, G, r]): the expert each GPU's slot receives (or
    returns), -1 empty; set for the ``nvlink``, ``fabric`` and ``host_engine`` paths (destination: the slot's
    GPU; source: ``home``)."""
    home: np.ndarray | None = None
    """int32 [L, E]: each expert's home GPU, the other end of every slot copy (with ``slots``)."""
    src: np.ndarray | None = None
    """int64 [N]: the sending GPU of each move (``network`` and ``migration`` paths)."""
    dst: np.ndarray | None = None
    """int64 [N]: the receiving GPU of each move."""
    copies: int = 1
    """Times the bytes cross per update pass (a redundant sync's reduction and broadcast: 2)."""
    recompute: bool = False
    """A recompute pass (``workload.rl_passes``) repeats one copy (a forward fill)."""

    def __post_init__(self) -> None:
        per_slot = self.path in SLOT_PATHS
        if per_slot != (self.slots is not None and self.home is not None):
            raise ValueError(f"transfer {self.kind} on path {self.path}: slots and home go with {SLOT_PATHS}")
        if not per_slot and (self.src is None or self.dst is None):
            raise ValueError(f"transfer {self.kind} on path {self.path}: src and dst are required")

    @property
    def per_layer(self) -> bool:
        """Priced per (micro-batch, layer) (``slots``); False: once per step (``src`` to ``dst``)."""
        return self.slots is not None


@dataclass(frozen=True)
class TransferSchedule:
    """Every weight transfer of one batch, in the order they are priced (per-layer sums keep it)."""

    layer_shape: tuple[int, ...]
    """``(Mb, L)``: the batch's micro-batches and MoE layers (the shape of the per-layer charges; a planner
    pricing one micro-batch's layers: ``(L,)``)."""
    transfers: tuple[Transfer, ...] = ()
    buffer_slots: int = 0
    """Most replica slots any GPU fills in one (micro-batch, layer) (``replica_buffer_bytes``)."""
    moved: int = 0
    """(layer, expert) pairs whose home changed (``reorder_moved_experts``)."""

    def of(self, kind: TransferKind) -> tuple[Transfer, ...]:
        """The schedule's transfers of one kind."""
        return tuple(t for t in self.transfers if t.kind == kind)


@dataclass(frozen=True)
class TransferCharge:
    """What a schedule costs (:func:`price_transfers`)."""

    layer_exposed: np.ndarray
    """float64 [Mb, L] (``layer_shape``): exposed seconds of the per-layer transfers (the per-layer
    ``t_sync_exposed_s``)."""
    recompute_exposed: np.ndarray
    """float64 [Mb, L] (``layer_shape``): exposed seconds of the copies a recompute pass repeats."""
    exposed: dict[str, float]
    """Exposed seconds of each kind in the schedule, summed over the batch."""
    hidden: dict[str, float]
    """Seconds of each kind in the schedule that its overlap hides, summed over the batch."""
    network_bytes: dict[str, float]
    """Bytes each per-step kind sends between GPUs (``migration``: ``migration_bytes``)."""

    def step_exposed(self, kind: TransferKind) -> float:
        """Exposed seconds of a per-step kind (0.0 where the schedule has none)."""
        return self.exposed.get(kind, 0.0)


def replicas_per_slot(plan: BatchPlan) -> np.ndarray:
    """int32 [Mb, L, G, r]: the plan's replica slots, or the non-home experts it computes when unlisted."""
    if plan.replicas is not None:
        return np.asarray(plan.replicas)
    g = plan.assign.shape[-1]
    non_home = (plan.assign > 0) & (plan.home[None, :, :, None] != np.arange(g))  # [Mb, L, E, G]
    if plan.redundant is not None:
        # NOTE: copies in permanent redundant slots are not refilled per layer.
        held = np.zeros(non_home.shape[1:], dtype=bool)  # [L, E, G]
        l, gg, _ = np.nonzero(plan.redundant >= 0)
        held[l, plan.redundant[plan.redundant >= 0], gg] = True
        non_home &= ~held[None]
    r = int(non_home.sum(axis=2).max()) if non_home.size else 0
    out = np.full((*non_home.shape[:2], g, max(r, 0)), -1, dtype=np.int32)
    if r:
        m, l, e, gg = np.nonzero(non_home)
        key = (m * non_home.shape[1] + l) * g + gg
        order = np.argsort(key, kind="stable")
        key, e = key[order], e[order]
        start = np.r_[0, np.flatnonzero(np.diff(key)) + 1]
        slot = np.arange(key.size) - np.repeat(start, np.diff(np.r_[start, key.size]))
        out.reshape(-1, r)[key, slot] = e
    return out


def redundant_transfer(plan: BatchPlan, cost: CostModel) -> Transfer | None:
    """The sync of the plan's permanent redundant copies: each copy's GPU reduces its gradients home and the
    home broadcasts the updated weights back (bf16 both ways, ``copies=2``); None without redundant copies."""
    if plan.redundant is None or not (plan.redundant >= 0).any():
        return None
    l, g, _ = np.nonzero(plan.redundant >= 0)
    experts = plan.redundant[plan.redundant >= 0]
    home = plan.home[l, experts]
    return Transfer(
        kind="redundant_sync",
        path="network",
        overlap="none",
        bytes_each=cost.expert_weight_bytes(),
        src=g.astype(np.int64),
        dst=home.astype(np.int64),
        copies=2,
    )


def buffer_transfers(
    slots: np.ndarray, home: np.ndarray, weight_bytes: float, host_path: bool = False
) -> tuple[Transfer, Transfer]:
    """The ``replica_fill`` and ``gradient_return`` of slots planned before the batch (slots int32
    [..., L, G, r], home int32 [L, E]): over the home node's NVLink, or with ``host_path`` the fill through
    the transfer engine and the gradients over the fabric."""
    fill: TransferPath = "host_engine" if host_path else "nvlink"
    # NOTE: the host path reads weights the host holds; gradients are made on the copies' GPUs and summed
    # into their homes' accumulators, so they return over the fabric.
    back: TransferPath = "fabric" if host_path else "nvlink"
    return (
        Transfer("replica_fill", fill, "forward_attention", weight_bytes, slots, home, recompute=True),
        Transfer("gradient_return", back, "backward_attention", weight_bytes, slots, home),
    )


def refill_exposed(
    cost: CostModel, slots: np.ndarray, home: np.ndarray, attention: np.ndarray | float
) -> np.ndarray:
    """float64 [..., L]: exposed seconds of the replica buffer's fill and gradient return over NVLink for
    slots [..., L, G, r] from ``home`` [L, E] behind ``attention`` (fwd + bwd seconds, broadcast with the
    layers), priced by :func:`price_transfers`: what the simulator charges a plan made before the batch,
    for planners that compare slot contents (:mod:`relibra.planners.refill`)."""
    slots = np.asarray(slots)
    transfers = buffer_transfers(slots, np.asarray(home), cost.expert_weight_bytes())
    schedule = TransferSchedule(layer_shape=tuple(slots.shape[:-2]), transfers=transfers)
    return price_transfers(schedule, cost, np.asarray(attention, dtype=np.float64)).layer_exposed


def plan_transfers(plan: BatchPlan, cost: CostModel, prev_home: np.ndarray) -> TransferSchedule:
    """The schedule of ``plan``: its slot copies, their gradient return, the migration from ``prev_home``
    [L, E] (one re-homed expert's payload: ``expert_params * cost.migration.bytes_per_param`` bytes) and the
    redundant sync.

    A plan marked ``online`` copies on the fabric after routing (``online_copy``, ``exposed_copies`` times;
    a gradient return behind the backward attention where ``overlapped_gradient_reduce``); one marked
    ``host_path`` fills through the transfer engine and returns gradients on the fabric; any other fills and
    returns over the home node's NVLink.
    """
    reps = replicas_per_slot(plan)  # [Mb, L, G, r]
    home = np.asarray(plan.home)
    weight = cost.expert_weight_bytes()
    out: list[Transfer] = []
    if reps.size:
        if plan.online is not None:
            # NOTE: an online planner's copies may leave the node (LLEP), so they are priced on the fabric.
            copies = plan.online.exposed_copies
            out.append(
                Transfer("online_copy", "fabric", "none", weight, reps, home, copies=copies, recompute=True)
            )
            if plan.online.overlapped_gradient_reduce:
                out.append(Transfer("gradient_return", "fabric", "backward_attention", weight, reps, home))
        else:
            out.extend(buffer_transfers(reps, home, weight, plan.host_path))
    src, dst = migration_moves(prev_home, home)
    payload = cost.model.expert_params * cost.migration.bytes_per_param
    out.append(Transfer("migration", "migration", "post_rollout", payload, src=src, dst=dst))
    redundant = redundant_transfer(plan, cost)
    if redundant is not None:
        out.append(redundant)
    return TransferSchedule(
        layer_shape=(int(plan.assign.shape[0]), int(plan.assign.shape[1])),
        transfers=tuple(out),
        buffer_slots=int((reps >= 0).sum(axis=-1).max()) if reps.size else 0,
        moved=int(src.size),
    )


def _slot_seconds(cost: CostModel, t: Transfer) -> np.ndarray:
    """float64 [Mb, L]: one copy of a per-layer transfer, the busiest link bounding it."""
    assert t.slots is not None and t.home is not None
    if t.path == "nvlink":
        return np.asarray(cost.replica_refill_time(t.slots, t.home))
    if t.path == "fabric":
        return np.asarray(cost.fabric_copy_time(t.slots, t.home))
    return np.asarray(cost.engine_copy_time(t.slots, t.home))


def step_charge(cost: CostModel, t: Transfer) -> tuple[float, float, float]:
    """A per-step transfer's (exposed seconds, hidden seconds, bytes sent between GPUs), all its copies:
    a ``post_rollout`` transfer's part beyond ``cost.migration.window_s`` is exposed, any other's in full."""
    assert t.src is not None and t.dst is not None
    if t.path == "migration":
        seconds, network_moves = payload_seconds(cost, t.src, t.dst, t.bytes_each)
        sent = float(network_moves * t.bytes_each)
    else:
        seconds, sent = cost.transfer_time(t.src, t.dst, t.bytes_each), float(t.src.size * t.bytes_each)
    if t.overlap == "post_rollout":
        exposed = max(0.0, seconds - cost.migration.window_s)
    else:
        exposed = t.copies * seconds
    return exposed, t.copies * seconds - exposed, t.copies * sent


def _exposed(seconds: np.ndarray, overlap: Overlap, attention: np.ndarray) -> np.ndarray:
    """Exposed seconds of one copy [Mb, L] behind ``overlap`` (attention [Mb, 1]: fwd + bwd seconds)."""
    if overlap == "forward_attention":
        return np.maximum(seconds - attention / 3, 0)
    if overlap == "backward_attention":
        return np.maximum(seconds - 2 * attention / 3, 0)
    return seconds


def price_transfers(schedule: TransferSchedule, cost: CostModel, attention: np.ndarray) -> TransferCharge:
    """The one pricing of a batch's weight transfers.

    ``attention`` float64 [Mb, 1]: the busiest GPU's attention seconds (fwd + bwd) of one layer per
    micro-batch, which hides the per-layer transfers of the ``forward_attention`` (a third) and
    ``backward_attention`` (two thirds) overlaps; ``cost.migration.window_s`` hides a ``post_rollout`` one. A
    per-layer copy is priced once per (path, slots) and charged ``copies`` times; per-layer exposed seconds
    are summed in schedule order.
    """
    attention = np.asarray(attention, dtype=np.float64)
    layer: np.ndarray | None = None
    recompute: np.ndarray | None = None
    exposed: dict[str, float] = {}
    hidden: dict[str, float] = {}
    network: dict[str, float] = {}
    priced: dict[tuple[str, int], np.ndarray] = {}
    for t in schedule.transfers:
        if t.per_layer:
            key = (t.path, id(t.slots))
            if key not in priced:
                priced[key] = np.asarray(_slot_seconds(cost, t), dtype=np.float64)
            seconds = priced[key]
            one = _exposed(seconds, t.overlap, attention)
            charged = one if t.copies == 1 else t.copies * one
            layer = charged if layer is None else layer + charged
            if t.recompute:
                recompute = one if recompute is None else recompute + one
            exposed[t.kind] = exposed.get(t.kind, 0.0) + float(charged.sum())
            hidden[t.kind] = hidden.get(t.kind, 0.0) + float((t.copies * (seconds - one)).sum())
            continue
        step_exposed, step_hidden, sent = step_charge(cost, t)
        exposed[t.kind] = exposed.get(t.kind, 0.0) + step_exposed
        hidden[t.kind] = hidden.get(t.kind, 0.0) + step_hidden
        network[t.kind] = network.get(t.kind, 0.0) + sent
    return TransferCharge(
        layer_exposed=np.zeros(schedule.layer_shape) if layer is None else np.asarray(layer),
        recompute_exposed=np.zeros(schedule.layer_shape) if recompute is None else np.asarray(recompute),
        exposed=exposed,
        hidden=hidden,
        network_bytes=network,
    )
