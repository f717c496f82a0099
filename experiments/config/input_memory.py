"""Whether a run's input can be held in this host's memory, checked before it is built
(:func:`experiments.config.checks.check_config`).

A run holds its per-sample counts ``[S, L, E]`` int32 (:class:`relibra.types.SampleCounts`), built from a
trace file (:meth:`relibra.trace.format.RoutingTrace.to_counts`) or by the synthetic generator; the
workload and the plans come on top, so these bytes are a lower bound. A run whose lower bound exceeds the
kernel's ``MemAvailable`` is refused naming the keys and the size, instead of a ``MemoryError`` (or the
kernel's OOM killer) part-way. A trace file's own arrays are checked the same way when it is read
(:func:`relibra.trace.format.load_trace`). Where the host does not publish ``MemAvailable`` (not Linux)
nothing is checked.
"""

from __future__ import annotations

from experiments.config.build import read_trace
from experiments.config.spec import RunSpec
from relibra.trace.format import counts_bytes, host_memory_problem

__all__ = ["input_memory_problems"]


def input_memory_problems(spec: RunSpec) -> list[str]:
    """One problem when the run's per-sample counts cannot fit in this host's memory (module doc); call on a
    config whose trace and sizes passed the other checks."""
    layers = spec.model.num_moe_layers
    experts = spec.model.num_experts
    path = spec.trace.path
    if path:
        trace = read_trace(path)
        shape = (trace.num_samples, trace.num_layers, trace.num_experts)
        what = f"trace.path={path}: its per-sample counts {list(shape)} int32"
        need = counts_bytes(*shape)
        hint = "split the trace into smaller files"
    else:
        batches = spec.trace.num_batches
        per_batch = spec.trace.samples_per_batch
        samples = batches * per_batch
        what = (
            f"trace.num_batches * trace.samples_per_batch = {batches} * {per_batch} samples: their "
            f"per-sample counts [{samples}, model.num_moe_layers={layers}, model.num_experts={experts}] int32"
        )
        need = counts_bytes(samples, layers, experts)
        hint = "lower trace.samples_per_batch or trace.num_batches"
    why = host_memory_problem(what, need)
    return [f"{why} (a lower bound on the run's input); {hint}"] if why else []
