"""What a torch-executor run holds in memory, estimated before any process starts.

Each rank of :class:`~relibra.executors.torch_executor.TorchExecutor` keeps, per MoE layer, the flat fp32
weight rows of its home experts and of its replica and redundant slots (``3 * hidden * ffn`` values each,
:class:`~relibra.executors.torch_moe.ExpertShape`), the layer's attention projection ``[H, H]`` and router
``[E, H]``, and for each of them a gradient and Adam's two moments (``torch.optim.Adam`` keeps
``exp_avg`` and ``exp_avg_sq``). Activations are left out, so the estimate is a lower bound: a run whose
lower bound does not fit the memory it would use is refused before it starts.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["FP32_BYTES", "STATE_COPIES", "available_host_bytes", "rank_bytes"]

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
