"""Refuse a plan the torch executor cannot run faithfully, before any communication starts.

The executor checks every :class:`~relibra.types.BatchPlan` against the invariants below in the parent
process (and again per rank) so that a wrong plan fails with a message naming the violated invariant
instead of hanging a collective or silently computing with a misplaced copy:

``shape``             arrays have the documented ranks and agree on ``Mb``, ``L``, ``E``, ``G``.
``gpu-range``         GPU ids in ``home`` lie in ``[0, G)``; expert ids in slots lie in ``[-1, E)``.
``home-balance``      every GPU is home to exactly ``E / G`` experts of every layer.
``non-negative``      ``assign >= 0`` and ``load >= 0``.
``conservation``      ``sum_g assign[m, l, e, :] == sum_j load[m, l, :, e]``.
``slot-capacity``     ``replicas`` has at most the executor's ``replica_slots`` columns and ``redundant``
                      at most its ``redundant_slots`` columns.
``slot-duplicate``    a GPU's replica slots of one (micro-batch, layer) name an expert at most once, and never
                      one of the GPU's own home experts (redundant slots may: such copies compute as one).
``replica-node``      a replica (layer-shared buffer slot) sits in the node of its expert's home GPU.
``copy-present``      every GPU with ``assign[m, l, e, g] > 0`` and ``g != home[l, e]`` holds ``e`` in a
                      replica or redundant slot.
``routes-match-load`` when the real routes are given: ``load`` is their bincount per source GPU.
"""

from __future__ import annotations

import numpy as np

from relibra.types import BatchPlan

__all__ = ["PlanRefused", "check_plan", "routes_load"]


class PlanRefused(ValueError):
    """A plan violates an executor invariant. ``invariant`` is its name (module docstring)."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"plan refused [{invariant}]: {detail}")
        self.invariant = invariant
        self.detail = detail


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def routes_load(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """Bincount of one source GPU's routes. routes int [T, L, k] -> int64 [L, E]."""
    t, num_layers, k = routes.shape
    flat = routes.transpose(1, 0, 2).reshape(num_layers, t * k).astype(np.int64)
    offset = (np.arange(num_layers, dtype=np.int64) * num_experts)[:, None]
    return np.bincount((flat + offset).ravel(), minlength=num_layers * num_experts).reshape(
        num_layers, num_experts
    )


def _check_shapes(plan: BatchPlan, num_gpus: int) -> tuple[int, int, int]:
    if plan.home.ndim != 2:
        raise PlanRefused("shape", f"home has shape {plan.home.shape}; expected [L, E]")
    num_layers, num_experts = plan.home.shape
    if plan.assign.ndim != 4 or plan.assign.shape[1:] != (num_layers, num_experts, num_gpus):
        raise PlanRefused(
            "shape",
            f"assign has shape {plan.assign.shape}; expected [Mb, {num_layers}, {num_experts}, {num_gpus}]",
        )
    mb = plan.assign.shape[0]
    if plan.load.shape != (mb, num_layers, num_gpus, num_experts):
        raise PlanRefused(
            "shape",
            f"load has shape {plan.load.shape}; expected [{mb}, {num_layers}, {num_gpus}, {num_experts}]",
        )
    if plan.replicas is not None and (
        plan.replicas.ndim != 4 or plan.replicas.shape[:3] != (mb, num_layers, num_gpus)
    ):
        raise PlanRefused(
            "shape", f"replicas has shape {plan.replicas.shape}; expected [{mb}, {num_layers}, {num_gpus}, r]"
        )
    if plan.redundant is not None and (
        plan.redundant.ndim != 3 or plan.redundant.shape[:2] != (num_layers, num_gpus)
    ):
        raise PlanRefused(
            "shape", f"redundant has shape {plan.redundant.shape}; expected [{num_layers}, {num_gpus}, R]"
        )
    if num_experts % num_gpus != 0:
        raise PlanRefused("shape", f"E={num_experts} experts cannot be spread evenly over G={num_gpus} GPUs")
    return mb, num_layers, num_experts


def _check_slots(slots: np.ndarray, home: np.ndarray, name: str, strict: bool = True) -> None:
    """slots int [..., L, G, s] (expert or -1), home [L, E]: range and (``strict``) duplicate checks."""
    num_experts = home.shape[1]
    bad = (slots < -1) | (slots >= num_experts)
    if bad.any():
        idx = _first(bad)
        raise PlanRefused(
            "gpu-range", f"{name}{list(idx)} = {slots[idx]}; expected an expert id in [-1, {num_experts})"
        )
    if not strict:
        return
    if slots.shape[-1] > 1:
        srt = np.sort(slots, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        if dup.any():
            idx = _first(dup.any(axis=-1))
            raise PlanRefused(
                "slot-duplicate", f"{name}{list(idx)} holds an expert twice: {slots[idx].tolist()}"
            )
    num_layers, num_gpus = slots.shape[-3], slots.shape[-2]
    layer = np.arange(num_layers)[:, None, None]
    gpu = np.arange(num_gpus)[None, :, None]
    own = (slots >= 0) & (home[layer, np.maximum(slots, 0)] == gpu)
    if own.any():
        idx = _first(own)
        raise PlanRefused(
            "slot-duplicate",
            f"{name}{list(idx)} = expert {slots[idx]} whose home is that same GPU; "
            "a slot must hold a non-home expert",
        )


def check_plan(
    plan: BatchPlan,
    num_gpus: int,
    gpus_per_node: int,
    replica_slots: int,
    redundant_slots: int = 0,
    routes: list[np.ndarray] | None = None,
    replica_same_node: bool = True,
) -> None:
    """Raise :class:`PlanRefused` naming the first violated invariant; return None for a runnable plan.

    ``routes``: optional per-micro-batch list of ``Mb`` arrays, each a list of ``G`` int arrays
    ``[T_j, L, k]`` (the replayed routes of each source GPU) as nested sequences; checked against ``load``.
    ``replica_same_node=False`` lifts ``replica-node`` (PopFetcher's prefetch buffer pulls across nodes).
    """
    mb, num_layers, num_experts = _check_shapes(plan, num_gpus)
    home = np.asarray(plan.home)
    if home.min(initial=0) < 0 or home.max(initial=0) >= num_gpus:
        idx = _first((home < 0) | (home >= num_gpus))
        raise PlanRefused("gpu-range", f"home{list(idx)} = {home[idx]}; expected a GPU id in [0, {num_gpus})")
    per_gpu = np.stack([(home == g).sum(axis=1) for g in range(num_gpus)], axis=1)  # [L, G]
    if (per_gpu != num_experts // num_gpus).any():
        layer, gpu = _first(per_gpu != num_experts // num_gpus)
        raise PlanRefused(
            "home-balance",
            f"layer {layer}: GPU {gpu} is home to {per_gpu[layer, gpu]} experts; expected E / G = "
            f"{num_experts // num_gpus}",
        )
    for name, arr in (("assign", plan.assign), ("load", plan.load)):
        if (arr < 0).any():
            idx = _first(arr < 0)
            raise PlanRefused("non-negative", f"{name}{list(idx)} = {arr[idx]}; expected >= 0")
    computed = plan.assign.sum(axis=-1, dtype=np.int64)
    routed = plan.load.sum(axis=-2, dtype=np.int64)
    if (computed != routed).any():
        idx = _first(computed != routed)
        raise PlanRefused(
            "conservation",
            f"(micro-batch, layer, expert) {idx}: sum_g assign = {computed[idx]} "
            f"but sum_j load = {routed[idx]}",
        )

    # Which non-home copies each GPU holds: held[m, l, e, g].
    held = np.zeros((mb, num_layers, num_experts, num_gpus), dtype=bool)
    node = np.arange(num_gpus) // gpus_per_node
    if plan.replicas is not None:
        reps = np.asarray(plan.replicas)
        if reps.shape[-1] > replica_slots:
            raise PlanRefused(
                "slot-capacity",
                f"replicas has {reps.shape[-1]} slots per GPU; "
                f"the executor's buffer has replica_slots={replica_slots}",
            )
        _check_slots(reps, home, "replicas")
        m_i, l_i, g_i, _ = np.nonzero(reps >= 0)
        e_i = reps[m_i, l_i, g_i, _]
        far = (node[home[l_i, e_i]] != node[g_i]) & replica_same_node
        if far.any():
            i = int(np.argmax(far))
            raise PlanRefused(
                "replica-node",
                f"replicas[{m_i[i]}, {l_i[i]}, {g_i[i]}] = expert {e_i[i]} on node {node[g_i[i]]}, "
                f"but its home GPU {home[l_i[i], e_i[i]]} is on node {node[home[l_i[i], e_i[i]]]}; "
                "replicas must stay in the home node",
            )
        held[m_i, l_i, e_i, g_i] = True
    if plan.redundant is not None:
        red = np.asarray(plan.redundant)
        if red.shape[-1] > redundant_slots:
            raise PlanRefused(
                "slot-capacity",
                f"redundant has {red.shape[-1]} slots per GPU; "
                f"the executor has redundant_slots={redundant_slots}",
            )
        # NOTE: EPLB may put two physical copies of one expert on one GPU (its home and a redundant slot, or
        # two redundant slots); they compute as one copy, so redundant slots are not held to slot-duplicate.
        _check_slots(red, home, "redundant", strict=False)
        l_i, g_i, _ = np.nonzero(red >= 0)
        held[:, l_i, red[l_i, g_i, _], g_i] = True
    at_home = np.arange(num_gpus)[None, None, :] == home[..., None]  # [L, E, G]
    missing = (plan.assign > 0) & ~at_home[None] & ~held
    if missing.any():
        m, layer, e, g = _first(missing)
        raise PlanRefused(
            "copy-present",
            f"assign[{m}, {layer}, {e}, {g}] = {plan.assign[m, layer, e, g]} tokens on GPU {g}, "
            f"which is not expert {e}'s home ({home[layer, e]}) and holds no replica or redundant copy of it",
        )
    if routes is not None:
        if len(routes) != mb:
            raise PlanRefused(
                "routes-match-load", f"routes cover {len(routes)} micro-batches; the plan has {mb}"
            )
        for m, per_gpu_routes in enumerate(routes):
            for j, r in enumerate(per_gpu_routes):
                got = routes_load(np.asarray(r), num_experts)
                if not np.array_equal(got, plan.load[m, :, j, :]):
                    layer, e = _first(got != plan.load[m, :, j, :])
                    raise PlanRefused(
                        "routes-match-load",
                        f"micro-batch {m}, source GPU {j}, layer {layer}, expert {e}: the routes send "
                        f"{got[layer, e]} tokens but load says {plan.load[m, layer, j, e]}",
                    )
