"""What a torch-executor run holds in memory and how long it takes, estimated before any process starts.

Each rank of :class:`~relibra.executors.torch_executor.TorchExecutor` keeps, per MoE layer, the flat fp32
weight rows of its home experts and of its replica and redundant slots (``3 * hidden * ffn`` values each,
:class:`~relibra.executors.torch_moe.ExpertShape`), the layer's attention projection ``[H, H]`` and router
``[E, H]``, and for each of them a gradient and Adam's two moments (``torch.optim.Adam`` keeps
``exp_avg`` and ``exp_avg_sq``). Activations are left out, so the estimate is a lower bound: a run whose
lower bound does not fit the memory it would use is refused before it starts.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import numpy as np

__all__ = [
    "FP32_BYTES",
    "STATE_COPIES",
    "available_cores",
    "available_host_bytes",
    "cell_overhead_s",
    "estimate_time_s",
    "layer_flops",
    "matmul_rate",
    "rank_bytes",
    "workload_flops",
]

FP32_BYTES = 4
"""Bytes of one fp32 value (the executor's weights and optimizer state are fp32)."""

STATE_COPIES = 4
"""Copies of every weight a rank holds: the weight, its gradient and Adam's two moments (torch.optim.Adam)."""


def rank_bytes(num_layers: int, num_experts: int, num_gpus: int, hidden: int, ffn: int, slots: int) -> int:
    """Lower bound on one rank's memory (bytes): module docstring.

    ``slots``: replica plus redundant slots per rank; ``num_experts / num_gpus`` experts are at home.
    """
    experts = num_experts // max(num_gpus, 1) + max(slots, 0)
    per_layer = experts * 3 * hidden * ffn + hidden * hidden + num_experts * hidden
    return num_layers * per_layer * FP32_BYTES * STATE_COPIES


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's ``MemAvailable`` (bytes), or None where it is not published (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# ------------------------------------------------------------------------------------------------ time
RATE_PROBE_S = 0.05
"""Wall seconds the matmul rate probe runs for (the brief bound is 0.2 s; 0.05 s gives a stable rate)."""


def layer_flops(
    source_tokens: np.ndarray, expert_rows: np.ndarray, hidden: int, ffn: int, experts: int
) -> np.ndarray:
    """FLOPs of one layer's forward and backward on each rank, as :mod:`relibra.executors.torch_moe` runs it.

    source_tokens [..., G] (tokens each rank holds), expert_rows [..., G] (routed rows each rank's experts
    compute) -> float64 [..., G]. Counted (2 FLOPs per multiply-add): the attention stand-in
    ``[T, H] @ [H, H]`` and router ``[T, H] @ [H, E]``, forward 1x and backward 2x (input and weight
    gradients): ``6 T H (H + E)``; the expert FFN's three matmuls ``2 N H F`` each, forward 1x, backward 3x
    (``_ExpertCompute`` recomputes the forward, then both gradients): ``4 * 6 N H F``.
    Element-wise ops, softmax and all-to-all are left out.
    """
    t = np.asarray(source_tokens, dtype=np.float64)
    n = np.asarray(expert_rows, dtype=np.float64)
    return 6.0 * t * hidden * (hidden + experts) + 24.0 * n * hidden * ffn


def workload_flops(
    load: np.ndarray, home: np.ndarray, top_k: int, hidden: int, ffn: int, warmup: bool
) -> np.ndarray:
    """FLOPs per (micro-batch, layer) of the busiest rank: load [M, L, G, E] (slots of each source rank),
    home [L, E] (the static placement: every token computed at home, the unbalanced reference; a planner
    only lowers the busiest rank's rows) -> float64 [M (+1 with warmup), L].

    ``warmup``: the executor runs the first micro-batch twice
    (:class:`~relibra.executors.torch_executor.RunOptions`).
    """
    load = np.asarray(load, dtype=np.int64)
    m, _, g, e = load.shape
    source = load.sum(axis=-1) / top_k  # [M, L, G]
    per_expert = load.sum(axis=2)  # [M, L, E]
    onehot = home[:, :, None] == np.arange(g)  # [L, E, G]
    rows = np.einsum("mle,leg->mlg", per_expert, onehot.astype(np.int64))  # [M, L, G]
    flops = layer_flops(source, rows, hidden, ffn, e).max(axis=-1)  # [M, L]
    return np.concatenate([flops[:1], flops]) if warmup and m else flops


def cell_overhead_s(cell_s: float, cell_flops: float, rate: float) -> float:
    """Seconds of a probed (micro-batch, layer) cell that its FLOPs at ``rate`` do not explain: the Python
    loop over experts, index and scatter ops, the Adam step's share (:func:`relibra.executors.time_probe.
    cell_cost` measures ``cell_s`` for a cell of ``cell_flops``); never negative."""
    return max(cell_s - cell_flops / rate, 0.0)


def estimate_time_s(
    flops: np.ndarray, rate: float, overhead_s: float, world: int, cores: int, start_s: float
) -> float:
    """Wall seconds of a torch-executor run: ``flops`` [M, L] of the busiest rank per (micro-batch, layer)
    (collectives make every rank wait for it), each cell costing ``overhead_s`` (:func:`cell_overhead_s`)
    plus its FLOPs at ``rate`` FLOP/s per rank, plus ``start_s`` to start one rank; all slowed by
    ``world / cores`` where ranks outnumber cores (each rank runs one thread)."""
    share = max(1.0, world / max(cores, 1))
    cells = overhead_s * np.size(flops) + float(np.sum(flops)) / rate
    return (cells + start_s) * share


@functools.cache
def matmul_rate(hidden: int, ffn: int, device: str = "cpu") -> float:
    """FLOP/s of fp32 ``[256, hidden] @ [hidden, ffn]`` on one thread (as a worker runs), measured for
    :data:`RATE_PROBE_S` seconds; cached per process and shape."""
    import torch  # NOTE: only executor=torch needs torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(256, hidden, device=device)
        w = torch.randn(hidden, ffn, device=device)
        (x @ w).sum().item()  # first-call costs
        reps, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < RATE_PROBE_S:
            for _ in range(8):
                y = x @ w
            if device != "cpu":
                y.sum().item()
            reps += 8
    finally:
        torch.set_num_threads(threads)
    return 2.0 * 256 * hidden * ffn * reps / elapsed


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count`` where that is not published)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
