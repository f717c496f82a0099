"""The loop every online per-(micro-batch, layer) copy planner shares: UltraEP, MoonEP and ECHO plan each
(micro-batch, layer) after routing from its exact loads, their planning sits on the critical path, and they
keep Megatron-LM's static placement (no reordering). Each supplies only its per-layer kernel.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from relibra.planners.protocols import BatchContext, static_placement
from relibra.types import BatchPlan, OnlineCopies

__all__ = ["LayerKernel", "plan_every_microbatch"]

LayerKernel = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""One (micro-batch, layer)'s loads ``x`` int64 [G, E] -> (assign int [E, G], replicas int [G, r])."""


def plan_every_microbatch(
    ctx: BatchContext,
    kernel: LayerKernel,
    replica_slots: int,
    critical_path_s: float | None,
    prefix: str,
    t0: float,
) -> BatchPlan:
    """Plan every (micro-batch, layer) of ``ctx.load`` [Mb, L, G, E] with ``kernel``, timing each call.

    ``critical_path_s``: seconds charged per (micro-batch, layer) on the critical path, or ``None`` for
    the measured time of each call (the kernel is called once untimed first, so a numba compilation or
    cache load is not measured). ``prefix`` names the method's stats (``<prefix>_measured_plan_s_per_layer``,
    ``<prefix>_critical_path_s_per_layer``, ``<prefix>_replicas_per_layer``); ``t0`` is when planning began
    (``time.perf_counter()``), for ``plan_time_s``. The copies are charged twice in full (forward fill and
    backward re-push) with their gradients reduced home under the backward
    (:class:`~relibra.types.OnlineCopies`).
    """
    mb, num_layers, g, num_experts = ctx.load.shape
    assign = np.zeros((mb, num_layers, num_experts, g), np.int32)
    replicas = np.full((mb, num_layers, g, replica_slots), -1, np.int32)
    measured = np.zeros((mb, num_layers))
    x = np.asarray(ctx.load, dtype=np.int64)
    kernel(x[0, 0])  # NOTE: untimed, so a compilation or cache load is not measured.
    for m in range(mb):
        for layer in range(num_layers):
            t = time.perf_counter()
            a, rep = kernel(x[m, layer])
            measured[m, layer] = time.perf_counter() - t
            assign[m, layer], replicas[m, layer] = a, rep
    charged = measured if critical_path_s is None else np.full_like(measured, critical_path_s)
    copies = (replicas >= 0).sum(axis=-1)
    stats = {
        f"{prefix}_measured_plan_s_per_layer": float(measured.mean()),
        f"{prefix}_critical_path_s_per_layer": float(charged.mean()),
        f"{prefix}_replicas_per_layer": float(copies.sum(axis=-1).mean()),
        "replicas_mean": float(copies.mean()),
        "reorder_moved_experts": 0.0,
    }
    return BatchPlan(
        home=static_placement(num_layers, num_experts, g),
        assign=assign,
        load=ctx.load,
        sample_gpu=ctx.sample_gpu,
        replicas=replicas,
        plan_time_s=time.perf_counter() - t0,
        stats=stats,
        online=OnlineCopies(critical_path_s=charged, exposed_copies=2, overlapped_gradient_reduce=True),
    )
