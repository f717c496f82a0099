"""Run a ``plans.npz`` on the torch executor under ``torchrun`` (``env://`` rendezvous; one or many nodes).

Every process started by ``torchrun`` (or any launcher that sets the same environment) is one GPU of the EP
group::

    torchrun --standalone --nproc-per-node=4 -m relibra.executors.launch --plans runs/x/plans.npz --out out/
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        -m relibra.executors.launch --plans plans.npz --out out/   # slurm/executor_multinode.sbatch

Rank, local rank and world size come from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (and ``MASTER_ADDR`` /
``MASTER_PORT``), the process group from ``init_process_group(init_method="env://")``: NCCL with one CUDA
device per local rank when CUDA is available, gloo on CPU otherwise (``--backend`` overrides).

Each rank reads and checks the dump (:func:`relibra.plan_dump.check_plan_dump`), rebuilds one
:class:`~relibra.types.BatchPlan` per batch (:func:`plans_from_dump`: a GPU's replica slots are the non-home
experts it computes, ascending), refuses a plan the executor cannot run (:mod:`.plan_check`) before any
communication, then runs every batch on a small expert shape (``--hidden``, ``--ffn``) with
:func:`~relibra.executors.torch_executor.run_batches`. Only rank 0 writes, atomically (temp file +
``os.replace``):

``executor.json``  world, backend, device, shape, measured ``moe_time_s`` sum, fill wait, reorder seconds.
``executor.npz``   ``moe_time_s`` float64 [M, L] (slowest rank, forward + backward of every (micro-batch,
                   layer)); with ``--record`` also, per global micro-batch ``m`` and rank ``j``,
                   ``routes/m{m}/g{j}`` int64 [T, L, k], ``hidden/…``, ``out/…``, ``grad_hidden/…`` float32
                   [T, H], and per batch ``b``: ``grad_experts/b{b}`` [L, E, P], ``grad_attn/b{b}`` [L, H, H],
                   ``grad_router/b{b}`` [L, E, H] (summed over ranks; the loss is ``sum(out ** 2)``).

``--record`` runs with ``lr = 0`` so that every batch starts from the self-identifying initial weights
(:func:`~relibra.executors.torch_moe.expert_init`) and :func:`~relibra.executors.torch_moe.reference_forward`
reproduces every output and gradient in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from relibra.atomic import atomic_write
from relibra.executors.plan_check import PlanRefused, check_plan
from relibra.executors.torch_executor import RunOptions, run_batches
from relibra.executors.torch_moe import ExpertShape
from relibra.plan_dump import check_plan_dump
from relibra.types import BatchPlan

__all__ = ["DistEnv", "main", "plans_from_dump", "slot_table"]


def _domain(meta: Mapping[str, Any]) -> int:
    """GPUs per NVLink domain of a dump's meta (``nvl_domain``; dumps written before it: the node)."""
    return int(meta.get("nvl_domain", meta["gpus_per_node"]))


def slot_table(home: np.ndarray, assign: np.ndarray, width: int) -> np.ndarray:
    """Replica slots that hold exactly the non-home experts each GPU computes.

    home [L, E], assign [Mb, L, E, G] -> int32 [Mb, L, G, w] (experts ascending, -1 padded), ``w`` the larger
    of ``width`` and the most non-home experts any GPU computes (a plan needing more is refused later).
    """
    num_experts, num_gpus = assign.shape[2:]
    non_home = (assign > 0) & (home[None, :, :, None] != np.arange(num_gpus))  # [Mb, L, E, G]
    per_gpu = non_home.transpose(0, 1, 3, 2)  # [Mb, L, G, E]
    w = max(width, int(per_gpu.sum(axis=-1).max(initial=0)))
    # experts ascending first, -1 after: sort keys put non-held experts past E
    keys = np.where(per_gpu, np.arange(num_experts), num_experts)
    order = np.sort(keys, axis=-1)[..., :w]
    return np.where(order < num_experts, order, -1).astype(np.int32)


def plans_from_dump(
    source: str | os.PathLike[str] | Mapping[str, Any],
) -> tuple[list[BatchPlan], dict[str, Any]]:
    """Read and check a ``plans.npz`` (README.md, "Plan dump"); one executor plan per batch, and the meta.

    Without redundant slots each micro-batch's replicas are :func:`slot_table`; with redundant slots
    (EPLB+, LPLB+) the batch's redundant table lists every non-home expert a GPU computes in any of its
    micro-batches. Raises :class:`~relibra.invariants.PlanInvariantError` for a dump that breaks the format.
    """
    if isinstance(source, Mapping):
        arrays = dict(source)
    else:
        with np.load(source, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    meta = check_plan_dump(arrays)
    home, assign, load = arrays["home"], arrays["assign"], arrays["load"]
    mb_batch, sample_mb = arrays["mb_batch"], arrays["sample_mb"]
    plans = []
    for b in range(home.shape[0]):
        mbs = np.flatnonzero(mb_batch == b)
        a = assign[mbs]
        replicas: np.ndarray | None = None
        redundant: np.ndarray | None = None
        if int(meta["redundant_slots"]) == 0:
            replicas = slot_table(home[b], a, int(meta["replica_slots"]))
        else:
            union = (a > 0).any(axis=0, keepdims=True).astype(np.int32)  # [1, L, E, G]
            redundant = slot_table(home[b], union, int(meta["redundant_slots"]))[0]
        plans.append(
            BatchPlan(
                home=home[b],
                assign=a,
                load=load[mbs],
                sample_gpu=arrays["sample_gpu"][np.isin(sample_mb, mbs)],
                replicas=replicas,
                redundant=redundant,
            )
        )
    return plans, meta


class DistEnv:
    """The process's place in the group, from torchrun's environment variables."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        missing = [
            k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in environ
        ]
        if missing:
            raise RuntimeError(
                f"environment lacks {missing}; start this module with torchrun (or set RANK, LOCAL_RANK, "
                "WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does)"
            )
        self.rank = int(environ["RANK"])
        self.local_rank = int(environ["LOCAL_RANK"])
        self.world = int(environ["WORLD_SIZE"])


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relibra.executors.launch", description=__doc__.split("\n")[0])
    p.add_argument("--plans", required=True, type=Path, help="plans.npz (README.md, 'Plan dump')")
    p.add_argument("--out", required=True, type=Path, help="directory rank 0 writes executor.{json,npz} into")
    p.add_argument("--hidden", type=int, default=64, help="expert hidden size actually run [64]")
    p.add_argument("--ffn", type=int, default=32, help="expert FFN size actually run [32]")
    p.add_argument("--batches", type=int, default=None, help="run only the first N batches [all]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4, help="Adam step after each batch; 0: none [1e-4]")
    p.add_argument("--no-warmup", action="store_true", help="do not run the first micro-batch twice")
    p.add_argument("--record", action="store_true", help="write inputs, outputs and gradients (sets lr=0)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    p.add_argument("--timeout-s", type=float, default=600.0, help="collective timeout [600]")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = _parse(argv)
    env = DistEnv(os.environ if environ is None else environ)
    plans, meta = plans_from_dump(args.plans)
    if args.batches is not None:
        plans = plans[: args.batches]
    num_gpus = int(meta["nodes"]) * int(meta["gpus_per_node"])
    if env.world != num_gpus:
        raise RuntimeError(
            f"WORLD_SIZE={env.world} but the plans are for nodes x gpus_per_node = {num_gpus} GPUs; start "
            f"torchrun with {meta['nodes']} nodes of {meta['gpus_per_node']} processes"
        )
    replica_slots = max((p.replicas.shape[-1] for p in plans if p.replicas is not None), default=0)
    redundant_slots = max((p.redundant.shape[-1] for p in plans if p.redundant is not None), default=0)
    in_node = bool(meta.get("replicas_in_home_node", True))
    for b, plan in enumerate(plans):  # every rank refuses the same plan before any communication
        try:
            check_plan(plan, num_gpus, _domain(meta), replica_slots, redundant_slots, None, in_node)
        except PlanRefused as err:
            raise PlanRefused(err.invariant, f"batch {b}: {err.detail}") from None

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world,
        timeout=timedelta(seconds=args.timeout_s),
        device_id=device if backend == "nccl" else None,
    )
    try:
        shape = ExpertShape(args.hidden, args.ffn)
        opts = RunOptions(
            top_k=int(meta["top_k"]),
            shape=shape,
            replica_slots=replica_slots,
            redundant_slots=redundant_slots,
            seed=args.seed,
            warmup=not args.no_warmup,
            lr=0.0 if args.record else args.lr,
            record=args.record,
        )
        res = run_batches(env.rank, env.world, plans, opts, device)
        if env.rank == 0:
            _write(args.out, res, meta, backend, device, shape, env.world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _write(
    out: Path,
    res: dict[str, Any],
    meta: dict[str, Any],
    backend: str,
    device: torch.device,
    shape: ExpertShape,
    world: int,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"moe_time_s": res["moe_time_s"]}
    for m, per_rank in enumerate(res.get("records", [])):
        for j, rec in enumerate(per_rank):
            for key, value in rec.items():
                arrays[f"{key}/m{m}/g{j}"] = value
    for b, grads in enumerate(res.get("batch_grads", [])):
        for key, value in grads.items():
            arrays[f"grad_{key}/b{b}"] = value
    atomic_write(out / "executor.npz", lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]
    summary = {
        "planner": meta["planner"],
        "world": world,
        "backend": backend,
        "device": str(device.type),
        "hidden": shape.hidden,
        "ffn": shape.ffn,
        "microbatches": int(res["moe_time_s"].shape[0]),
        "measured_moe_time_s": float(res["moe_time_s"].sum()),
        "replica_fill_wait_s": res["fill_wait_s"],
        "t_reorder_s": res["reorder_s"],
        "reorder_moved_experts": res["reorder_moved_experts"],
        "replica_buffer_bytes": res["replica_buffer_bytes"],
    }
    text = json.dumps(summary, indent=2).encode()
    atomic_write(out / "executor.json", lambda f: f.write(text))


if __name__ == "__main__":
    sys.exit(main())
