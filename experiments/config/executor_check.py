"""The executor's settings (``executor.*``) and its time estimate, checked before any work (issue "torch
executor"; :func:`experiments.config.checks.check_config` and :func:`experiments.run.run` call these)."""

from __future__ import annotations

import numpy as np

from experiments.config.spec import RunSpec

__all__ = ["TORCH_BACKENDS", "TORCH_START_METHODS", "_executor_problems", "executor_time_problem"]


TORCH_BACKENDS = ("gloo", "nccl")
TORCH_START_METHODS = ("spawn", "fork")


def _yaml(value: object) -> str:
    """``value`` as the command line writes it (``null`` for None)."""
    return "null" if value is None else str(value)


def _least(key: str, value: int | None, least: int, problems: list[str]) -> int | None:
    """``value`` when it is unset or >= ``least``; else a problem naming ``key`` and None."""
    if value is not None and value < least:
        problems.append(f"{key}={value}: must be >= {least}")
        return None
    return value


def _executor_problems(spec: RunSpec, num_gpus: int | None) -> list[str]:
    """``executor=torch``: its shape and backend settings, and its memory estimated before any process
    starts (:mod:`relibra.executors.budget`, a lower bound), against what this host (or GPU) has. The
    settings' types were checked against :class:`~relibra.executors.torch_executor.TorchExecutor`'s
    fields when the spec was built (:func:`experiments.config.spec.build_spec`); here their ranges."""
    executor = spec.executor
    if executor.name != "torch":
        return []
    problems: list[str] = []
    hidden = _least("executor.hidden", executor.setting("hidden"), 1, problems)
    ffn = _least("executor.moe_ffn", executor.setting("moe_ffn"), 1, problems)
    slots = [
        _least(f"executor.{k}", executor.setting(k), 0, problems)
        for k in ("replica_slots", "redundant_slots")
    ]
    max_world = _least("executor.max_world", executor.setting("max_world"), 1, problems)
    max_time = executor.setting("max_time_s")
    if max_time is not None and max_time < 0:
        problems.append(f"executor.max_time_s={max_time}: must be >= 0")
    backend = executor.setting("backend")
    if backend not in TORCH_BACKENDS:
        problems.append(f"executor.backend={backend!r}: choose one of {', '.join(TORCH_BACKENDS)}")
    start = executor.setting("start_method")
    if start not in TORCH_START_METHODS:
        problems.append(f"executor.start_method={start!r}: choose one of {', '.join(TORCH_START_METHODS)}")
    if num_gpus is None or problems:
        return problems
    if max_world is not None and num_gpus > max_world:
        problems.append(
            f"executor.max_world={max_world}: the torch executor starts one process per GPU and the cluster "
            f"has {num_gpus} (raise executor.max_world or use a smaller cluster)"
        )
    gpu_bytes: int | None = None
    if backend == "nccl":
        import torch  # NOTE: only executor=torch needs torch; imported here, not at module import

        if not torch.cuda.is_available() or torch.cuda.device_count() < num_gpus:
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            return [
                *problems,
                f"executor.backend=nccl needs one CUDA GPU per rank ({num_gpus}) and this host has {found}; "
                "use executor.backend=gloo on CPU",
            ]
        gpu_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(num_gpus))
    from relibra.executors.budget import available_host_bytes, rank_bytes

    shape_h = hidden if hidden is not None else spec.model.hidden
    shape_f = ffn if ffn is not None else spec.model.moe_ffn
    planner_slots = spec.planner.setting("replica_slots") or 0
    held = (slots[0] if slots[0] is not None else int(planner_slots)) + (slots[1] or 0)
    per_rank = rank_bytes(spec.model.num_moe_layers, spec.model.num_experts, num_gpus, shape_h, shape_f, held)
    limit, where = (
        (gpu_bytes, "each GPU has") if gpu_bytes is not None else (available_host_bytes(), "this host has")
    )
    need = per_rank if gpu_bytes is not None else per_rank * num_gpus
    if limit is not None and need > limit:
        problems.append(
            f"executor.hidden={_yaml(hidden)} executor.moe_ffn={_yaml(ffn)} (expert shape {shape_h} x "
            f"{shape_f}): the torch executor needs at least {need / 2**30:.1f} GiB ({num_gpus} ranks of "
            f"{per_rank / 2**30:.1f} GiB: "
            f"fp32 weights, gradients and Adam moments of each rank's experts) and {where} "
            f"{limit / 2**30:.1f} GiB available; give a smaller executor.hidden / executor.moe_ffn"
        )
    return problems


def executor_time_problem(spec: RunSpec, load: np.ndarray, num_gpus: int) -> str | None:
    """``executor=torch``: why the run would exceed ``executor.max_time_s`` (None: it fits, or no limit).

    The estimate (:func:`relibra.executors.budget.estimate_time_s`) counts the FLOPs of every micro-batch
    and layer of the workload ``load`` [M, L, G, E] at the executor's expert shape, under the static
    placement, at a matmul rate measured on this host now, plus the per-cell overhead and the process start
    measured now (:mod:`relibra.executors.time_probe`).
    """
    executor = spec.executor
    if executor.name != "torch":
        return None
    limit = executor.setting("max_time_s")
    if limit is None:
        return None
    from relibra.executors import budget, time_probe

    hidden = int(executor.setting("hidden") or spec.model.hidden)
    ffn = int(executor.setting("moe_ffn") or spec.model.moe_ffn)
    e, num_layers = spec.model.num_experts, load.shape[1]
    top_k = spec.model.top_k
    home = np.broadcast_to(np.arange(e) // (e // num_gpus), (num_layers, e))
    flops = budget.workload_flops(load, home, top_k, hidden, ffn, bool(executor.setting("warmup")))
    device = "cuda" if executor.setting("backend") == "nccl" else "cpu"
    rate = budget.matmul_rate(hidden, ffn, device)
    cores = num_gpus if device == "cuda" else budget.available_cores()
    per_rank = e // num_gpus
    tokens = round(float(load[0].sum()) / (top_k * num_gpus * num_layers)) if load.size else 0
    probe_h, probe_f = hidden, ffn
    if per_rank * 3 * hidden * ffn > time_probe.PROBE_MAX_PARAMS:
        probe_h, probe_f = 64, 32  # NOTE: the executor's default shape (TorchExecutor); compute at `rate`
    cell = time_probe.cell_cost(per_rank, max(tokens, 1), top_k, probe_h, probe_f)
    probe_rate = rate if (probe_h, probe_f) == (hidden, ffn) else budget.matmul_rate(probe_h, probe_f)
    overhead = budget.cell_overhead_s(cell.seconds, cell.flops, probe_rate)
    start = (
        cell.init_s
        + cell.first_s
        + (time_probe.start_cost_s() if executor.setting("start_method") == "spawn" else 0.0)
    )
    est = budget.estimate_time_s(flops, rate, overhead, num_gpus, cores, start)
    if est <= float(limit):
        return None
    return (
        f"executor.max_time_s={_yaml(limit)}: the torch executor run is estimated at {est:.0f} s "
        f"({flops.shape[0]} micro-batch passes x {num_layers} layers of expert shape {hidden} x {ffn} on "
        f"{num_gpus} ranks, {rate / 1e9:.1f} GFLOP/s and {cell.seconds * 1e3:.1f} ms per probed cell "
        "per rank measured here); give a smaller "
        "executor.hidden / executor.moe_ffn, fewer batches (trace.num_batches), or raise executor.max_time_s "
        "(null: no limit)"
    )
