"""Refuse a plan the torch executor cannot run faithfully, before any communication starts.

The executor checks every :class:`~relibra.types.BatchPlan` in the parent process (and again per rank) so
that a wrong plan fails with a message naming the violated invariant instead of hanging a collective or
silently computing with a misplaced copy. The invariants are the shared ones of :mod:`relibra.invariants`
(same names, same functions), read strictly, plus two that only an executor needs:

``shape`` / ``dtype``   int32 arrays with the documented ranks that agree on ``Mb``, ``L``, ``E``, and on
                        ``G`` = the executor's world size.
``home range``          GPU ids in ``home`` lie in ``[0, G)``.
``home balance``        every GPU is home to exactly ``E / G`` experts of every layer (always: the executor
                        holds ``E / G`` home rows per layer, also next to redundant slots).
``load >= 0``, ``assign >= 0``, ``token conservation``
                        ``sum_g assign[m, l, e, :] == sum_j load[m, l, :, e]``.
``slot capacity``       ``replicas`` has at most the executor's ``replica_slots`` columns and (executor only)
                        ``redundant`` at most its ``redundant_slots`` columns.
``slot range``          expert ids in slots lie in ``[-1, E)``.
``slot duplicate``      a GPU's replica slots of one (micro-batch, layer) name an expert at most once, and
                        never one of the GPU's own home experts (redundant slots may: such copies compute
                        as one).
``replica slots`` / ``redundant slots``
                        no GPU computes more distinct experts than its slots allow.
``replicas in home node``
                        a replica (layer-shared buffer slot) sits in the node of its expert's home GPU.
``slot contents``       every GPU with ``assign[m, l, e, g] > 0`` and ``g != home[l, e]`` holds ``e`` in a
                        replica or redundant slot (a plan that lists no slots may compute at home only).
``routes match load``   (executor only) when the real routes are given: ``load`` is their bincount per source
                        GPU.
"""

from __future__ import annotations

import numpy as np

from relibra.invariants import PlanInvariantError, check_assignment, first_index
from relibra.types import BatchPlan

__all__ = ["PlanRefused", "check_plan", "routes_load"]


class PlanRefused(PlanInvariantError):
    """A plan the executor refuses; ``invariant`` names the violated invariant (module docstring).

    A :class:`~relibra.invariants.PlanInvariantError`, so callers may catch either.
    """

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(invariant, detail)
        self.args = (f"plan refused [{invariant}]: {detail}",)


def routes_load(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """Bincount of one source GPU's routes. routes int [T, L, k] -> int64 [L, E]."""
    t, num_layers, k = routes.shape
    flat = routes.transpose(1, 0, 2).reshape(num_layers, t * k).astype(np.int64)
    offset = (np.arange(num_layers, dtype=np.int64) * num_experts)[:, None]
    return np.bincount((flat + offset).ravel(), minlength=num_layers * num_experts).reshape(
        num_layers, num_experts
    )


def _check_executor_slots(plan: BatchPlan, num_gpus: int, redundant_slots: int) -> None:
    """The executor's own reading: ``G`` is its world size and ``redundant`` fits its allocated slots."""
    assign = np.asarray(plan.assign)
    if assign.ndim != 4 or assign.shape[-1] != num_gpus:
        raise PlanRefused(
            "shape", f"assign has shape {assign.shape}; expected [Mb, L, E, G={num_gpus}] (the world size)"
        )
    if plan.redundant is not None and plan.redundant.ndim == 3 and plan.redundant.shape[-1] > redundant_slots:
        raise PlanRefused(
            "slot capacity",
            f"redundant has {plan.redundant.shape[-1]} slots per GPU; "
            f"the executor has redundant_slots={redundant_slots}",
        )


def _check_routes(plan: BatchPlan, routes: list) -> None:
    mb, _, num_experts, _ = plan.assign.shape
    if len(routes) != mb:
        raise PlanRefused("routes match load", f"routes cover {len(routes)} micro-batches; the plan has {mb}")
    for m, per_gpu_routes in enumerate(routes):
        for j, r in enumerate(per_gpu_routes):
            got = routes_load(np.asarray(r), num_experts)
            if not np.array_equal(got, plan.load[m, :, j, :]):
                layer, e = first_index(got != plan.load[m, :, j, :])
                raise PlanRefused(
                    "routes match load",
                    f"micro-batch {m}, source GPU {j}, layer {layer}, expert {e}: the routes send "
                    f"{got[layer, e]} tokens but load says {plan.load[m, layer, j, e]}",
                )


def check_plan(
    plan: BatchPlan,
    num_gpus: int,
    gpus_per_node: int,
    replica_slots: int,
    redundant_slots: int = 0,
    routes: list | None = None,
    replica_same_node: bool = True,
) -> None:
    """Raise :class:`PlanRefused` naming the first violated invariant; return None for a runnable plan.

    ``routes``: optional list of ``Mb`` micro-batches, each a list of ``G`` int arrays ``[T_j, L, k]``
    (the replayed routes of each source GPU); checked against ``load``.
    ``replica_same_node=False`` lifts ``replicas in home node`` (PopFetcher's prefetch buffer pulls across
    nodes).
    """
    try:
        _check_executor_slots(plan, num_gpus, redundant_slots)
        check_assignment(
            plan.home,
            plan.assign,
            plan.load,
            gpus_per_node=gpus_per_node,
            replica_slots=replica_slots,
            redundant_slots=redundant_slots,
            replicas_in_home_node=replica_same_node,
            replicas=plan.replicas,
            redundant=plan.redundant,
            require_home_balance=True,
            require_slots=True,
            where="plan",
        )
    except PlanRefused:
        raise
    except PlanInvariantError as err:
        raise PlanRefused(err.invariant, err.detail) from None
    if routes is not None:
        _check_routes(plan, routes)
