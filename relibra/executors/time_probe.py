"""Measurements behind the torch executor's time estimate (:mod:`relibra.executors.budget`), at preflight.

:func:`cell_cost` runs :func:`relibra.executors.torch_executor.run_batches` (the function every worker runs:
reorder, per micro-batch the forward and backward of every layer, the Adam step) in this process as a world
of one rank (a gloo group over an in-memory store, so its all-to-alls are local copies) on a synthetic
workload shaped like one rank's share of the run, and reports the wall seconds per (micro-batch, layer).
:func:`start_cost_s` times a fresh interpreter importing the executor (what every ``spawn`` worker does).
Both are cached per process; what they leave out is listed in docs/executor.md ("Time estimate").
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["PROBE_CELLS", "PROBE_MAX_FLOPS", "START_TIMEOUT_S", "CellCost", "cell_cost", "start_cost_s"]

PROBE_CELLS = (2, 2)
"""(micro-batches, layers) of the timed probe (a first, untimed 1 x 1 call pays the first-call costs)."""

PROBE_MAX_FLOPS = 5e7
"""Cap on one probe cell's FLOPs (:func:`~relibra.executors.budget.layer_flops`): at the ~1-10 GFLOP/s of
one CPU thread the timed probe's 4 cells stay within the brief's ~0.3 s; larger shapes get fewer tokens."""

PROBE_MAX_PARAMS = 1 << 22
"""Cap on the probe's expert parameters per layer (16 MiB fp32): a larger shape is probed at the executor's
default 64 x 32 and its compute is charged at the measured matmul rate instead."""

START_TIMEOUT_S = 120.0
"""Bound on the import probe; a slower import is reported as this many seconds."""


@dataclass(frozen=True)
class CellCost:
    """Seconds and FLOPs of one probed (micro-batch, layer) cell of one rank."""

    seconds: float
    """Wall seconds per cell (the probe's total over its ``PROBE_CELLS`` cells)."""
    flops: float
    """FLOPs of one probe cell (:func:`~relibra.executors.budget.layer_flops` at the probe's shape)."""
    init_s: float
    """Seconds to create and destroy the one-rank process group."""
    first_s: float
    """Seconds of the first, untimed 1 x 1 call (first-call costs every fresh worker pays once)."""


def probe_tokens(tokens: int, experts: int, top_k: int, hidden: int, ffn: int) -> int:
    """Tokens of the probe rank: the run's ``tokens`` per rank, lowered until a cell fits PROBE_MAX_FLOPS,
    at least one per expert, a multiple of ``experts`` (every expert gets the same rows)."""
    from relibra.executors.budget import layer_flops

    per_expert = max(1, round(tokens / experts))
    while (
        per_expert > 1
        and layer_flops(
            np.array(per_expert * experts), np.array(per_expert * experts * top_k), hidden, ffn, experts
        )
        > PROBE_MAX_FLOPS
    ):
        per_expert //= 2
    return per_expert * experts


@functools.cache
def cell_cost(experts: int, tokens: int, top_k: int, hidden: int, ffn: int) -> CellCost:
    """Time one rank's work per (micro-batch, layer): ``experts`` home experts, ``tokens`` routed tokens per
    micro-batch (lowered by :func:`probe_tokens`), ``top_k`` routes each, expert shape ``hidden x ffn``."""
    import torch
    import torch.distributed as dist

    from relibra.executors.budget import layer_flops
    from relibra.executors.torch_executor import RunOptions, run_batches
    from relibra.executors.torch_moe import ExpertShape
    from relibra.types import BatchPlan

    if dist.is_initialized():
        raise RuntimeError("the time probe runs its own one-rank process group; one is already initialised")
    k = min(top_k, experts)
    t = probe_tokens(tokens, experts, k, hidden, ffn)

    def plans(m: int, num_layers: int) -> list[BatchPlan]:
        load = np.full((m, num_layers, 1, experts), t * k // experts, dtype=np.int32)
        return [
            BatchPlan(
                home=np.zeros((num_layers, experts), dtype=np.int32),
                assign=load.transpose(0, 1, 3, 2).copy(),
                load=load,
                sample_gpu=np.zeros(1, dtype=np.int32),
            )
        ]

    opts = RunOptions(k, ExpertShape(hidden, ffn), 0, 0, 0, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: as a worker runs (torch_executor._entry)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        run_batches(0, 1, plans(1, 1), opts)  # first-call costs
        first_s = time.perf_counter() - t0
        m, num_layers = PROBE_CELLS
        t0 = time.perf_counter()
        run_batches(0, 1, plans(m, num_layers), opts)
        seconds = (time.perf_counter() - t0) / (m * num_layers)
    finally:
        t1 = time.perf_counter()
        dist.destroy_process_group()
        init_s += time.perf_counter() - t1
        torch.set_num_threads(threads)
    flops = float(layer_flops(np.array(t), np.array(t * k), hidden, ffn, experts))
    return CellCost(seconds=seconds, flops=flops, init_s=init_s, first_s=first_s)


@functools.cache
def start_cost_s() -> float:
    """Wall seconds of ``python -c "import relibra.executors.torch_executor"`` in a fresh interpreter
    (bounded by START_TIMEOUT_S)."""
    t0 = time.perf_counter()
    try:
        subprocess.run(
            [sys.executable, "-c", "import relibra.executors.torch_executor"],
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return START_TIMEOUT_S
    return time.perf_counter() - t0
