"""The ``torch`` executor: runs batch plans on real processes (gloo on CPU, NCCL on GPUs) and times them.

:class:`TorchExecutor` implements :class:`relibra.executors.protocol.Executor`. For a sequence of
:class:`~relibra.types.BatchPlan` it

1. refuses any plan that breaks an executor invariant (:mod:`relibra.executors.plan_check`) before a single
   process starts;
2. spawns one process per GPU of the EP group (``cluster.nodes * cluster.gpus_per_node``), each holding its
   share of an :class:`~relibra.executors.torch_moe.EPMoEModel` with a small expert shape (``hidden``,
   ``moe_ffn``; the plan's ``E``, ``L`` and the model's ``top_k``);
3. per batch: moves experts to the plan's placement (weights, gradients, Adam state), fills the redundant
   slots; per micro-batch: synthesises replayed routes that reproduce ``plan.load`` exactly, runs forward and
   backward, times the MoE stages of every layer; then takes an optimizer step;
4. returns ``moe_time_s [M, L]``: the slowest rank's forward (dispatch to combine) plus backward (combine
   gradient to dispatch gradient) seconds of every (micro-batch, layer).

:func:`launch` is the small process launcher it uses (also used by the tests).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.executors.plan_check import PlanRefused, check_plan
from relibra.executors.protocol import ExecutionReport
from relibra.executors.reorder_ops import reorder_experts
from relibra.executors.torch_moe import EPMoEModel, ExpertShape, MicroBatchPlan, StageTimer
from relibra.types import BatchPlan

__all__ = [
    "RunOptions",
    "TorchExecutor",
    "launch",
    "microbatch_inputs",
    "microbatch_plan",
    "routes_from_load",
    "run_batches",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, fn: Callable[..., Any], world: int, port: int, args: tuple, outdir: str, backend: str
) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        try:
            out = fn(rank, world, *args)
        except Exception:
            # NOTE: spawn reports whichever rank dies first, often a peer that lost its connection; print the
            # original error of every rank so the cause is visible.
            print(f"[rank {rank}]\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            raise
        with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def launch(
    fn: Callable[..., Any], world: int, *args: Any, backend: str = "gloo", start_method: str = "spawn"
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` new processes joined in one process group.

    ``fn`` must be importable (a module-level function). ``start_method="fork"`` starts much faster on CPU
    (the children inherit the imported modules) but is unsafe once CUDA is initialised. Returns the ranks'
    return values, by rank.
    """
    with tempfile.TemporaryDirectory(prefix="relibra-torch-") as outdir:
        mp.start_processes(
            _entry,
            args=(fn, world, _free_port(), args, outdir, backend),
            nprocs=world,
            join=True,
            start_method=start_method,
        )
        results = []
        for rank in range(world):
            with open(Path(outdir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


def microbatch_plan(plan: BatchPlan, m: int) -> MicroBatchPlan:
    """Slice micro-batch ``m`` (local to the batch) out of a batch plan."""
    return MicroBatchPlan(
        home=plan.home,
        assign=plan.assign[m],
        load=plan.load[m],
        replicas=None if plan.replicas is None else plan.replicas[m],
        redundant=plan.redundant,
    )


def routes_from_load(load: np.ndarray, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Replayed routes of one source GPU that reproduce its loads exactly. load [L, E] -> int64 [T, L, k].

    Every layer must route the same ``T * k`` slots (true of any trace-derived load).
    """
    num_layers, num_experts = load.shape
    slots = load.sum(axis=1)
    if (slots != slots[0]).any() or slots[0] % top_k:
        raise ValueError(
            f"load rows sum to {slots.tolist()} slots per layer; "
            f"expected one multiple of top_k={top_k} for all layers"
        )
    t = int(slots[0]) // top_k
    out = np.empty((t, num_layers, top_k), dtype=np.int64)
    for layer in range(num_layers):
        ids = np.repeat(np.arange(num_experts), load[layer])
        out[:, layer, :] = rng.permutation(ids).reshape(t, top_k)
    return out


def microbatch_inputs(
    load: np.ndarray, top_k: int, hidden: int, seed: int, batch: int, microbatch: int, rank: int
) -> tuple[np.ndarray, torch.Tensor]:
    """Deterministic inputs of one source GPU for one micro-batch (``microbatch`` local to ``batch``).

    load [L, E] (``plan.load[m, :, rank, :]``) -> (replayed routes int64 [T, L, k], hidden float32 [T, H]).
    """
    routes = routes_from_load(load, top_k, np.random.default_rng([seed, batch, microbatch, rank]))
    gen = torch.Generator().manual_seed(
        (((seed * 1_009 + batch) * 1_013 + microbatch) * 1_019 + rank) & 0x7FFF_FFFF
    )
    return routes, torch.randn(routes.shape[0], hidden, generator=gen)


@dataclass(frozen=True)
class RunOptions:
    """What every rank needs besides the plans to run them."""

    top_k: int
    shape: ExpertShape
    replica_slots: int
    redundant_slots: int = 0
    seed: int = 0
    warmup: bool = True
    """Run the first micro-batch twice and time the second (first-call costs are not the plan's)."""
    lr: float = 1e-4
    """Adam learning rate of the step after every batch; 0 takes no step (weights stay as initialised)."""
    record: bool = False
    """Gather inputs, outputs and gradients to rank 0 (for equivalence checks against the reference)."""


def _full_expert_grads(model: EPMoEModel) -> torch.Tensor:
    """Every expert's weight gradient by expert id, summed over ranks: [L, E, P] (all ranks call it)."""
    full = torch.zeros(model.num_layers, model.num_experts, model.shape.params, device=model.device)
    for layer, p in enumerate(model.experts):
        if p.grad is not None:
            full[layer, torch.as_tensor(model.slot_expert[layer], device=model.device)] = p.grad
    dist.all_reduce(full)
    return full


def run_batches(
    rank: int, world: int, plans: Sequence[BatchPlan], opts: RunOptions, device: torch.device | str = "cpu"
) -> dict[str, Any]:
    """Run ``plans`` on this rank (every rank of the group calls it together).

    Per batch: reorder to the plan's placement (weights, gradients, Adam state), fill the redundant slots; per
    micro-batch: :func:`microbatch_inputs`, forward, backward of ``sum(out ** 2)`` (gradients accumulate over
    the batch's micro-batches); then an Adam step (``opts.lr > 0``). Returns, on every rank, ``moe_time_s``
    float64 [M, L] (slowest rank), ``fill_wait_s``, ``reorder_s``, ``reorder_moved_experts``,
    ``replica_buffer_bytes``; with ``opts.record`` also ``records`` (rank 0 only: per global micro-batch a
    list over ranks of dicts ``routes``, ``hidden``, ``out``, ``grad_hidden``) and ``batch_grads`` (per
    batch: ``experts`` [L, E, P], ``attn`` [L, H, H], ``router`` [L, E, H], summed over ranks).
    """
    num_layers, num_experts = plans[0].home.shape
    shape = opts.shape
    model = EPMoEModel(
        num_layers,
        num_experts,
        shape,
        rank,
        world,
        opts.replica_slots,
        opts.redundant_slots,
        opts.seed,
        device=device,
    )
    model.place_initial(plans[0].home)
    opt = torch.optim.Adam(model.parameters(), lr=opts.lr) if opts.lr > 0 else None
    total_mb = sum(p.assign.shape[0] for p in plans)
    times = torch.zeros(total_mb, num_layers, dtype=torch.float64, device=model.device)
    fill_wait = torch.zeros(1, dtype=torch.float64, device=model.device)
    reorder_s, moved = 0.0, 0
    records: list[dict[str, np.ndarray]] = []
    batch_grads: list[dict[str, np.ndarray]] = []
    m_global = 0
    for b, plan in enumerate(plans):
        dist.barrier()
        t0 = time.perf_counter()
        moved += reorder_experts(model, plan.home, opt)
        model.fill_redundant(plan.redundant)
        reorder_s += time.perf_counter() - t0
        for m in range(plan.assign.shape[0]):
            routes, hidden = microbatch_inputs(
                plan.load[m, :, rank, :], opts.top_k, shape.hidden, opts.seed, b, m, rank
            )
            mb_plan = microbatch_plan(plan, m)
            warm = opts.warmup and m_global == 0
            for rep in range(2 if warm else 1):
                if rep == 1:
                    model.zero_grad(set_to_none=False)
                h = hidden.to(model.device, copy=True).requires_grad_(opts.record)
                timer = StageTimer()
                out = model(h, routes, mb_plan, timer, microbatch=m)
                out.square().sum().backward()  # NOTE: also on a rank without tokens: backward is collective.
            if opts.record:
                grad_h = h.grad if h.grad is not None else torch.zeros_like(h)
                records.append(
                    {
                        "routes": routes,
                        "hidden": hidden.numpy(),
                        "out": out.detach().cpu().numpy(),
                        "grad_hidden": grad_h.detach().cpu().numpy(),
                    }
                )
            for layer in range(num_layers):
                times[m_global, layer] = timer.forward[(m, layer)] + timer.backward[(m, layer)]
                fill_wait += timer.fill_wait[(m, layer)]
            m_global += 1
        if opts.record:
            grads = {"experts": _full_expert_grads(model)}
            for name, p in (("attn", model.attn), ("router", model.router)):
                g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)
                grads[name] = g
            batch_grads.append({k: v.cpu().numpy() for k, v in grads.items()})
        if opt is not None:
            opt.step()
        model.zero_grad(set_to_none=False)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    dist.all_reduce(fill_wait, op=dist.ReduceOp.MAX)
    res: dict[str, Any] = {
        "moe_time_s": times.cpu().numpy(),
        "fill_wait_s": float(fill_wait.item()),
        "reorder_s": reorder_s,
        "reorder_moved_experts": float(moved),
        "replica_buffer_bytes": float(model.buffer.nbytes),
    }
    if opts.record:
        gathered: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        if rank == 0:
            assert gathered is not None
            res["records"] = [[gathered[j][i] for j in range(world)] for i in range(total_mb)]
        res["batch_grads"] = batch_grads
    return res


def _execute_rank(
    rank: int,
    world: int,
    plans: Sequence[BatchPlan],
    top_k: int,
    shape: ExpertShape,
    replica_slots: int,
    redundant_slots: int,
    seed: int,
    warmup: bool,
) -> dict[str, Any] | None:
    opts = RunOptions(top_k, shape, replica_slots, redundant_slots, seed, warmup)
    res = run_batches(rank, world, plans, opts)
    return res if rank == 0 else None


@dataclass(frozen=True)
class TorchExecutor:
    """Executes plans on ``G`` local processes; reports measured per-(micro-batch, layer) MoE seconds.

    ``hidden`` / ``moe_ffn`` give the expert shape actually run (small on CPU; None: the model's own).
    ``replica_slots`` / ``redundant_slots``: slots each rank allocates (None: the widest the plans use).
    """

    name: str = "torch"
    hidden: int | None = 64
    moe_ffn: int | None = 32
    replica_slots: int | None = None
    redundant_slots: int | None = None
    backend: str = "gloo"
    max_world: int = 16
    seed: int = 0
    warmup: bool = True
    start_method: str = "spawn"
    """``spawn`` (safe everywhere) or ``fork`` (CPU only; starts the processes in a fraction of the time)."""
    max_time_s: float | None = 600.0
    """Runs estimated (:mod:`relibra.executors.budget`) to take longer are refused at preflight (None: no
    limit); read by ``experiments.run``, which estimates before planning."""

    def execute(self, plans: Sequence[BatchPlan], model: ModelSpec, cluster: ClusterSpec) -> ExecutionReport:
        """Run ``plans`` (batches in order) and return measured ``moe_time_s`` [M, L] (slowest rank)."""
        if not plans:
            raise ValueError("plans is empty; expected at least one BatchPlan")
        world = cluster.num_gpus
        if world > self.max_world:
            raise ValueError(
                f"cluster has {world} GPUs; the torch executor spawns one process per GPU and allows at most "
                f"max_world={self.max_world} (raise executor.max_world or use a smaller cluster)"
            )
        r = self.replica_slots
        if r is None:
            r = max((p.replicas.shape[-1] for p in plans if p.replicas is not None), default=0)
        red = self.redundant_slots
        if red is None:
            red = max((p.redundant.shape[-1] for p in plans if p.redundant is not None), default=0)
        for b, plan in enumerate(plans):
            try:
                check_plan(plan, world, cluster.domain_gpus, r, red)
            except PlanRefused as err:
                raise PlanRefused(err.invariant, f"batch {b}: {err.detail}") from None
        shape = ExpertShape(self.hidden or model.hidden, self.moe_ffn or model.moe_ffn)
        results = launch(
            _execute_rank,
            world,
            list(plans),
            model.top_k,
            shape,
            r,
            red,
            self.seed,
            self.warmup,
            backend=self.backend,
            start_method=self.start_method,
        )
        res = results[0]
        return ExecutionReport(
            moe_time_s=res["moe_time_s"],
            extra={
                "measured_moe_time_s": float(res["moe_time_s"].sum()),
                "replica_fill_wait_s": res["fill_wait_s"],
                "t_reorder_s": res["reorder_s"],
                "reorder_moved_experts": res["reorder_moved_experts"],
                "replica_buffer_bytes": res["replica_buffer_bytes"],
                "world": float(world),
                "hidden": float(shape.hidden),
                "moe_ffn": float(shape.ffn),
            },
        )
