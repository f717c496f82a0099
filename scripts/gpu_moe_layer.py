"""Measure one MoE layer under controlled imbalance, the expert GEMM curves, NCCL all-to-all and the torch
executor on the visible GPUs; write one JSON that the calibration and the per-layer check read.

Usage (one node; relaunches itself under ``torchrun`` when more than one GPU is visible)::

    python scripts/gpu_moe_layer.py --out gpu_moe_layer.json       # parts stop starting after --budget-s 540
    python scripts/gpu_moe_layer.py --dry-run --out /tmp/moe.json  # CPU, gloo, tiny shapes, about 20 s

What it measures, each part failing soft (its ``status`` ``measured``, ``skipped`` or ``failed`` and the
``reason`` are written, never left out):

(a) ``moe_layer``: one MoE layer forward and backward (CUDA events, ``--warmup`` untimed iterations, the
    median of ``--repeats``; each iteration first queues a dense 8192^2 GEMM so that the layer's launches run
    ahead, as Megatron-LM's ``tests/functional_tests/test_cases/common/moe_perf/__main__.py`` does) of the
    per-layer proxies of ``experiments/data/moe_layer.json`` at ``--tokens-per-gpu`` tokens on every GPU,
    under replayed routes of known skew (:func:`workload_routes`): ``balanced`` (every expert exactly
    ``T k / E`` slots of every GPU), ``biased_S`` for each ``--skews`` S (the experts of rank 0 take ``S``
    times the mean per-GPU load, the rest share the remainder evenly), and the peer workloads
    ``W1_hot_expert_set`` and ``W2_hot_rank`` (NVIDIA/Megatron-LM PR #7488, :mod:`relibra.trace.peer`).
    Implementations: the plain-torch layer (:class:`TorchMoELayer`: router gathered at the replayed ids,
    permute, ``all_to_all_single`` dispatch, SwiGLU experts as one ``torch._grouped_mm`` per projection
    where the device runs it, else a loop over experts, combine), and megatron-core's ``MoELayer`` with the
    ``alltoall`` dispatcher and the ``flex`` dispatcher over DeepEP where ``deep_ep`` imports (routes fed
    through ``RouterReplay``, :mod:`relibra.megatron.replay`).
(b) ``models``: the expert GEMM curves of every model of ``experiments/conf/model``, by
    ``scripts/calibrate_gpu.py`` itself (same format: ``relibra.cost.calibration.load_calibration`` reads
    this file as ``cluster.calibration=FILE``), plus its device-to-device copy bandwidth.
(c) ``all_to_all``: NCCL ``all_to_all_single`` over payload sizes (more than one GPU).
(d) ``executor``: the torch executor (``relibra.executors``) over NCCL on a static plan and on a plan that
    moves one expert per GPU and replicates the hottest expert (more than one GPU).

``--dry-run`` runs every code path on the CPU (gloo, float32, tiny shapes, ``--world`` processes); its file
says ``"dry_run": true`` and the calibration refuses it. ``python -m experiments.validation.gpu_measurements
FILE`` turns the per-layer rows into rows of ``experiments/data/moe_layer.json`` (docs/validation.md,
"Measuring on a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # NOTE: run as a file (python scripts/...), the repository is not on the path
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate_gpu  # noqa: E402  (scripts/calibrate_gpu.py: the GEMM curves and the provenance fields)

LAYER_DATA = ROOT / "experiments" / "data" / "moe_layer.json"
"""The per-layer proxies (the ``model`` of each row) measured by default."""
DEFAULT_MODELS = ("deepseek-proxy", "mixtral-proxy")
PEER_WORKLOADS = ("W1_hot_expert_set", "W2_hot_rank")
"""The peer's workloads run here (NVIDIA/Megatron-LM PR #7488 at ``relibra.trace.peer.PEER_COMMIT``)."""
MOE_PERF_WARMUP, MOE_PERF_REPEATS = 5, 20
"""Megatron-LM moe_perf's ``WARMUP_ITERS`` and ``MEASURE_ITERS`` (``moe_perf/__main__.py``, d98e8a6)."""
PRE_GEMM = 8192
"""Side of the dense GEMM queued before each timed iteration (moe_perf's 'dummy GEMM', same file)."""
SKEW_RANKS_ONE_GPU = 8
"""On one GPU the skew is set over this many groups of contiguous experts (the moe_perf rows' EP 8)."""


class Skip(Exception):
    """A part cannot run here (a missing package, one GPU): recorded as ``skipped`` with its reason."""


# ----------------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a rank needs besides its place in the group (parsed and checked once)."""

    out: Path
    dry_run: bool
    models: tuple[dict[str, Any], ...]
    """ModelSpec fields of each layer model (shrunk under ``--dry-run``)."""
    tokens_per_gpu: int
    skews: tuple[float, ...]
    warmup: int
    repeats: int
    budget_s: float
    seed: int
    a2a_bytes: tuple[int, ...]
    executor_shape: tuple[int, int]
    executor_tokens: int
    parts: tuple[str, ...]
    command: str
    world: int
    """Processes to run: ``--world`` of a dry run, else the visible GPUs."""


PARTS = ("calibration", "moe_layer", "all_to_all", "executor")


def layer_models(names: list[str]) -> dict[str, dict[str, Any]]:
    """name -> ModelSpec fields, from experiments/data/moe_layer.json's rows and experiments/conf/model."""
    import yaml

    rows = json.loads(LAYER_DATA.read_text())["rows"]
    known = {r["model"]["name"]: dict(r["model"]) for r in rows}
    keys = list(next(iter(known.values())))
    for path in sorted(calibrate_gpu.CONF.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        known.setdefault(str(cfg["name"]), {k: cfg[k] for k in keys})
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"--models {unknown}: not among {sorted(known)}")
    return {n: known[n] for n in names}


def tiny(model: dict[str, Any]) -> dict[str, Any]:
    """The dry run's stand-in shape: hidden and FFN widths / 128 (experts and top-k kept)."""
    hidden = max(model["hidden"] // 128, 8)
    heads = 1
    return {
        **model,
        "hidden": hidden,
        "moe_ffn": max(model["moe_ffn"] // 128, 4),
        "shared_ffn": max(model["shared_ffn"] // 128, 4) if model["shared_experts"] else 0,
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden,
    }


def max_skew(model: dict[str, Any], ranks: int) -> float:
    """The largest per-GPU skew :func:`biased_shares` can route: no expert above ``T`` slots of a GPU (one
    per token) and the hot rank at most all of them."""
    e, k = model["num_experts"], model["top_k"]
    return min(float(ranks), e / k)


def parse(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_moe_layer.json"))
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, float32, tiny shapes (seconds)")
    p.add_argument("--world", type=int, default=2, help="processes of the dry run [2]")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="layer models")
    p.add_argument("--tokens-per-gpu", type=int, default=None, help="[4096; dry run 32]")
    p.add_argument(
        "--skews", type=float, nargs="+", default=[1.2, 1.5], help="force-biased max/mean [1.2 1.5]"
    )
    p.add_argument("--warmup", type=int, default=None, help=f"[{MOE_PERF_WARMUP}; dry run 1]")
    p.add_argument("--repeats", type=int, default=None, help=f"[{MOE_PERF_REPEATS}; dry run 2]")
    p.add_argument("--budget-s", type=float, default=540.0, help="parts not started by then are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    a = p.parse_args(argv)

    def bad(msg: str) -> None:
        print(f"gpu_moe_layer: {msg}", file=sys.stderr)
        raise SystemExit(2)

    if not a.dry_run and not torch.cuda.is_available():
        bad("no CUDA GPU is visible; run with --dry-run to exercise the script on the CPU")
    if a.world < 1:
        bad(f"--world {a.world}: expected at least 1")
    for name, value in (("--tokens-per-gpu", a.tokens_per_gpu), ("--repeats", a.repeats)):
        if value is not None and value < 1:
            bad(f"{name} {value}: expected at least 1")
    if a.warmup is not None and a.warmup < 0:
        bad(f"--warmup {a.warmup}: expected 0 or more")
    if not a.budget_s > 0:
        bad(f"--budget-s {a.budget_s}: expected a positive number of seconds")
    if not a.out.parent.is_dir():
        bad(f"--out {a.out}: its folder {a.out.parent} does not exist")
    try:
        models = layer_models(a.models)
    except ValueError as exc:
        bad(str(exc))
    world = a.world if a.dry_run else max(torch.cuda.device_count(), 1)
    tokens = a.tokens_per_gpu or (32 if a.dry_run else 4096)
    ranks = world if world > 1 else SKEW_RANKS_ONE_GPU
    for name, m in models.items():
        if m["num_experts"] % world or m["num_experts"] % ranks:
            bad(f"--models {name}: {m['num_experts']} experts cannot be spread over {ranks} GPUs")
        for s in a.skews:
            if not 1.0 < s <= max_skew(m, ranks):
                bad(
                    f"--skews {s}: expected above 1 and at most {max_skew(m, ranks):g} for {name} "
                    f"({m['num_experts']} experts, top-{m['top_k']}, {ranks} GPUs)"
                )
    if a.dry_run:
        models = {n: tiny(m) for n, m in models.items()}
    return Settings(
        out=a.out.resolve(),
        dry_run=a.dry_run,
        models=tuple(models.values()),
        tokens_per_gpu=tokens,
        skews=tuple(a.skews),
        warmup=a.warmup if a.warmup is not None else (1 if a.dry_run else MOE_PERF_WARMUP),
        repeats=a.repeats or (2 if a.dry_run else MOE_PERF_REPEATS),
        budget_s=a.budget_s,
        seed=a.seed,
        a2a_bytes=tuple(1 << s for s in (range(10, 17, 3) if a.dry_run else range(20, 31, 2))),
        executor_shape=(16, 8) if a.dry_run else (1024, 512),
        executor_tokens=16 if a.dry_run else 1024,
        parts=tuple(a.parts),
        command=shlex.join([sys.executable, *sys.argv]),
        world=world,
    )


# ------------------------------------------------------------------------------------------------ the group
@dataclasses.dataclass(frozen=True)
class Group:
    """This process's place: rank, world and device (one process per GPU)."""

    rank: int
    world: int
    device: torch.device

    def agree(self, flag: bool) -> bool:
        """True only if every rank's ``flag`` is (so every rank takes the same branch)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item() > 0)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [float(v) for v in t.cpu()]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Seconds between marks: CUDA events on a GPU (read after one synchronisation), else ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks."""
        _sync(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def time_fwd_bwd(
    group: Group, forward: Callable[[], torch.Tensor], grad: torch.Tensor, settings: Settings
) -> dict[str, Any]:
    """Forward and backward ms of ``forward()`` (its output's backward with the gradient ``grad``):
    ``warmup`` untimed, then ``repeats`` timed iterations; per iteration the slowest rank; medians."""
    pre = (
        torch.randn(PRE_GEMM, PRE_GEMM, device=group.device) if group.device.type == "cuda" else None
    )  # NOTE: fp32 as moe_perf's dummy GEMM
    fwd, bwd = [], []
    for it in range(settings.warmup + settings.repeats):
        dist.barrier()
        if pre is not None:
            torch.matmul(pre, pre)
        watch = Stopwatch(group.device)
        watch.mark()
        out = forward()
        watch.mark()
        out.backward(grad)
        watch.mark()
        f, b = watch.spans()
        if it >= settings.warmup:
            fwd.append(f)
            bwd.append(b)
    slow = group.max(fwd + bwd)
    n = len(fwd)
    return {
        "forward_ms": statistics.median(slow[:n]) * 1e3,
        "backward_ms": statistics.median(slow[n:]) * 1e3,
        "forward_ms_rank0": statistics.median(fwd) * 1e3 if group.rank == 0 else None,
        "backward_ms_rank0": statistics.median(bwd) * 1e3 if group.rank == 0 else None,
        "forward_timings_ms": [round(v * 1e3, 4) for v in slow[:n]],
        "backward_timings_ms": [round(v * 1e3, 4) for v in slow[n:]],
    }


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------ routing
def integer_counts(shares: np.ndarray, slots: int, offset: int) -> np.ndarray:
    """Largest-remainder rounding of ``shares [E] * slots`` to integers summing to ``slots``; ties go to the
    experts from ``offset`` on (so different GPUs' extra slots land on different experts)."""
    exact = shares * slots
    counts = np.floor(exact).astype(np.int64)
    rest = slots - int(counts.sum())
    order = np.lexsort(((np.arange(len(shares)) - offset) % len(shares), -(exact - counts)))
    counts[order[:rest]] += 1
    return counts


def routes_from_counts(counts: np.ndarray, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """Routes int64 [T, k] whose expert bincount is exactly ``counts [E]`` (sum ``T k``, each ``<= T``), the
    ``k`` experts of a token distinct: expert blocks laid end to end over the slots ``i T + t`` (token
    ``t``, position ``i``); a block of at most ``T`` slots never covers two positions of one token."""
    slots = int(counts.sum())
    if slots % top_k or counts.max(initial=0) > slots // top_k:
        raise ValueError(
            f"counts {counts.tolist()} cannot be routed top-{top_k} over {slots // top_k} tokens"
        )
    ids = np.repeat(np.arange(len(counts)), counts)
    routes = ids.reshape(top_k, slots // top_k).T
    return np.ascontiguousarray(routes[rng.permutation(len(routes))])


def biased_shares(num_experts: int, ranks: int, skew: float) -> np.ndarray:
    """Per-expert shares [E]: the ``E / ranks`` experts of rank 0 take ``skew / ranks`` of all slots."""
    per = num_experts // ranks
    shares = np.full(num_experts, (1.0 - skew / ranks) / (num_experts - per))
    shares[:per] = skew / num_experts
    return shares


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    """``balanced``, ``biased`` or ``peer``."""
    target_skew: float | None
    routes: tuple[np.ndarray, ...]
    """int64 [T, k] of each GPU."""
    source: str


def workload_routes(model: dict[str, Any], settings: Settings, world: int) -> Iterator[Workload]:
    """Every workload's routes for ``world`` GPUs of ``tokens_per_gpu`` tokens (module doc)."""
    e, k, t = model["num_experts"], model["top_k"], settings.tokens_per_gpu
    ranks = world if world > 1 else SKEW_RANKS_ONE_GPU

    def per_gpu(rank_shares: np.ndarray, tag: int) -> tuple[np.ndarray, ...]:
        """Each GPU's routes: slots per rank's experts by ``rank_shares [ranks]``, then evenly within."""
        out = []
        for j in range(world):
            per_rank = integer_counts(rank_shares, t * k, j)
            counts = np.concatenate(
                [integer_counts(np.full(e // ranks, ranks / e), int(c), j) for c in per_rank]
            )
            out.append(routes_from_counts(counts, k, np.random.default_rng([settings.seed, tag, j])))
        return tuple(out)

    even = np.full(ranks, 1.0 / ranks)
    yield Workload("balanced", "balanced", 1.0, per_gpu(even, 0), "exact equal shares")
    for i, s in enumerate(settings.skews):
        yield Workload(
            f"biased_{s:g}",
            "biased",
            s,
            per_gpu(biased_shares(ranks, ranks, s), i + 1),
            f"rank 0's experts take {s:g}x the mean per-GPU load of {ranks} GPUs, the rest share evenly",
        )
    try:
        from relibra.trace.peer import PEER_COMMIT, routes_for_step
    except ImportError as exc:
        raise Skip(
            f"relibra.trace.peer is not importable here ({exc}); carry its packages (omegaconf)"
        ) from exc
    for name in PEER_WORKLOADS:
        ids, _ = routes_for_step(name, e, k, t, 0, settings.seed)
        yield Workload(
            name,
            "peer",
            None,
            tuple(ids.astype(np.int64) for _ in range(world)),
            f"NVIDIA/Megatron-LM PR #7488 benchmark.py at {PEER_COMMIT[:8]}, step 0, seed {settings.seed}, "
            "every GPU the same routes (as the peer)",
        )


def routing_summary(w: Workload, num_experts: int, world: int) -> dict[str, Any]:
    """The routes' loads [G, E] (tokens each GPU sends each expert) and the realised per-GPU skew."""
    load = np.stack([np.bincount(r.reshape(-1), minlength=num_experts) for r in w.routes])
    ranks = world if world > 1 else SKEW_RANKS_ONE_GPU
    per_rank = load.sum(axis=0).reshape(ranks, -1).sum(axis=1)
    return {
        "name": w.name,
        "kind": w.kind,
        "target_skew": w.target_skew,
        "skew": float(per_rank.max() / per_rank.mean()),
        "skew_ranks": ranks,
        "expert_skew": float(load.sum(axis=0).max() / load.sum(axis=0).mean()),
        "source": w.source,
        "load": load.tolist(),
    }


# ------------------------------------------------------------------------------------ the plain-torch layer
def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _loop_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """SwiGLU of each expert over its rows (rows grouped by expert): x [N, H] -> [N, H]."""
    parts = [_swiglu(xi @ w1[i]) @ w2[i] for i, xi in enumerate(x.split(counts))]
    return torch.cat(parts) if parts else x.new_zeros(0, w2.shape[-1])


def _grouped_ffn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The same as :func:`_loop_ffn` with one ``torch._grouped_mm`` per projection."""
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=x.device)
    return torch._grouped_mm(_swiglu(torch._grouped_mm(x, w1, offs=offs)), w2, offs=offs)


def pick_ffn(
    device: torch.device, dtype: torch.dtype, experts: int, hidden: int, ffn: int
) -> tuple[Callable[..., torch.Tensor], str]:
    """``torch._grouped_mm`` when it runs forward and backward at the layer's shapes here and matches the loop
    (uneven groups, one empty), else the loop; returns the function and what was chosen and why."""
    if not hasattr(torch, "_grouped_mm"):
        return _loop_ffn, f"loop over experts (torch {torch.__version__} has no torch._grouped_mm)"
    try:
        g = _gen(1)
        counts = [16 * (i % 3) for i in range(experts)]
        counts[-1] += 16
        x = torch.randn(sum(counts), hidden, generator=g).to(device, dtype)
        w1 = (torch.randn(experts, hidden, 2 * ffn, generator=g) / hidden**0.5).to(device, dtype)
        w2 = (torch.randn(experts, ffn, hidden, generator=g) / ffn**0.5).to(device, dtype)
        outs = []
        candidates: tuple[Callable[..., torch.Tensor], ...] = (_grouped_ffn, _loop_ffn)
        for fn in candidates:
            ps = [t.clone().requires_grad_() for t in (x, w1, w2)]
            y = fn(*ps, counts)
            y.square().sum().backward()
            outs.append([y.detach().float(), *(p.grad.float() for p in ps)])  # type: ignore[union-attr]
        for a, b in zip(*outs):
            if not torch.allclose(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()) + 1e-6):
                return _loop_ffn, "loop over experts (torch._grouped_mm disagreed with the loop here)"
    except Exception as exc:  # NOTE: any failure of the private op means: use the loop
        why = f"{type(exc).__name__}: {exc}"[:300]
        return _loop_ffn, f"loop over experts (torch._grouped_mm failed at these shapes: {why})"
    return _grouped_ffn, "torch._grouped_mm (one per projection)"


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` rows [N, H] with split sizes; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        ctx.splits = (recv, send)
        out = x.new_empty(sum(recv), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        recv, send = ctx.splits
        out = grad.new_empty(sum(send), grad.shape[1])
        dist.all_to_all_single(out, grad.contiguous(), send, recv)
        return out, None, None


class TorchMoELayer(nn.Module):
    """One EP rank's share of a MoE layer in plain torch, staged as Megatron's all-to-all dispatcher.

    route (softmax router, gates gathered at the replayed ids and renormalised) -> permute (slots sorted by
    expert, so by destination GPU) -> dispatch (``all_to_all_single``, autograd) -> experts (rows regrouped
    by local expert; SwiGLU, ``w1 [E_loc, H, 2F]`` gate then up, ``w2 [E_loc, F, H]``) -> combine (inverse
    all-to-all) -> unpermute (each token sums its ``k`` gated outputs) + shared expert.
    """

    def __init__(self, model: dict[str, Any], group: Group, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        h, f, e = model["hidden"], model["moe_ffn"], model["num_experts"]
        self.num_experts, self.top_k, self.group = e, model["top_k"], group
        self.local = e // group.world
        g = _gen(seed * 1_000 + group.rank)
        dev = group.device
        self.router = nn.Parameter((torch.randn(e, h, generator=g) / h**0.5).to(dev))
        self.w1 = nn.Parameter((torch.randn(self.local, h, 2 * f, generator=g) / h**0.5).to(dev, dtype))
        self.w2 = nn.Parameter((torch.randn(self.local, f, h, generator=g) / f**0.5).to(dev, dtype))
        sf = model["shared_ffn"] * model["shared_experts"]
        self.shared = (
            nn.ParameterList(
                [
                    nn.Parameter((torch.randn(h, 2 * sf, generator=g) / h**0.5).to(dev, dtype)),
                    nn.Parameter((torch.randn(sf, h, generator=g) / sf**0.5).to(dev, dtype)),
                ]
            )
            if sf
            else None
        )
        self.ffn, self.ffn_note = pick_ffn(dev, dtype, self.local, h, f)

    def _a2a(self, x: torch.Tensor, recv: list[int], send: list[int]) -> torch.Tensor:
        return _AllToAll.apply(x, recv, send)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        t, k, world = x.shape[0], self.top_k, self.group.world
        probs = torch.softmax(x.float() @ self.router.T, dim=-1)  # [T, E]
        gates = probs.gather(1, routes)
        gates = (gates / gates.sum(dim=1, keepdim=True)).to(x.dtype)  # [T, k]
        flat = routes.reshape(-1)  # [T k]
        order = torch.argsort(flat, stable=True)
        rows = x[order // k]  # [T k, H], grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).view(world, self.local)  # [G, E_loc]
        if world > 1:
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts)  # [G(source), E_loc]
            counts_host = got.cpu()  # NOTE: the host needs the split sizes, as Megatron's dispatcher does
            send = counts.sum(dim=1).tolist()
            recv = counts_host.sum(dim=1).tolist()
            rows = self._a2a(rows, recv, send)
            expert_of = torch.arange(self.local, device=x.device).repeat(world)
            ids = torch.repeat_interleave(expert_of, got.reshape(-1))
            regroup = torch.argsort(ids, stable=True)
            per_expert = counts_host.sum(dim=0).tolist()
            y = rows.new_empty(rows.shape)
            y[regroup] = self.ffn(rows[regroup], self.w1, self.w2, per_expert)
            y = self._a2a(y, send, recv)
        else:
            y = self.ffn(rows, self.w1, self.w2, counts.reshape(-1).tolist())
        out = y.new_empty(y.shape)
        out = out.index_copy(0, order, y)  # back to slot order [T k, H]
        combined = (out.view(t, k, -1) * gates.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            combined = combined + _swiglu(x @ self.shared[0]) @ self.shared[1]
        return combined


# --------------------------------------------------------------------------------------- megatron's layer
def megatron_version() -> tuple[str | None, str | None]:
    """(megatron-core version, None) or (None, why it is not usable)."""
    try:
        importlib.import_module("megatron.core")
    except Exception as exc:  # NOTE: any import failure makes the Megatron part a recorded skip
        return None, f"megatron.core is not importable ({type(exc).__name__}: {exc})"
    try:
        return importlib.metadata.version("megatron-core"), None
    except importlib.metadata.PackageNotFoundError:
        import megatron.core

        return str(getattr(megatron.core, "__version__", "unknown")), None


def _optional_version(module: str, dist_name: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception:  # NOTE: not importable here: recorded as null
        return None
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist_name)
    return "unknown"


def megatron_layer(
    model: dict[str, Any], dispatcher: str, group: Group, dtype: torch.dtype, seed: int
) -> Any:
    """Megatron-core's ``MoELayer`` (EP = the group) with routing replay; ``dispatcher`` ``alltoall`` or
    ``flex-deepep``. Raises :class:`Skip` where the installed packages cannot build it."""
    version, why = megatron_version()
    if version is None:
        raise Skip(why)
    if dispatcher == "flex-deepep":
        if group.device.type != "cuda":
            raise Skip("DeepEP needs CUDA GPUs")
        if _optional_version("deep_ep", "deep_ep") is None:
            raise Skip("deep_ep is not importable (install DeepEP for the flex dispatcher)")
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = group.device.type == "cuda"
    if cuda:  # NOTE: any release with routing replay; the CPU patches are for the proven releases only
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(expert_model_parallel_size=group.world)
    else:
        from relibra.megatron.model import init_expert_parallel

        init_expert_parallel(group.world)  # the CPU patches (relibra.megatron.cpu_patches), EP groups
    if parallel_state.get_expert_model_parallel_world_size() != group.world:
        raise Skip(
            f"Megatron's parallel state has EP {parallel_state.get_expert_model_parallel_world_size()}"
        )
    cuda = group.device.type == "cuda"
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    use_te = cuda and _optional_version("transformer_engine", "transformer-engine") is not None
    grouped = use_te
    if cuda and not use_te:
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped = bool(grouped_gemm_util.grouped_gemm_is_available())
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=model["hidden"],
        num_attention_heads=1,
        ffn_hidden_size=model["moe_ffn"],
        moe_ffn_hidden_size=model["moe_ffn"],
        num_moe_experts=model["num_experts"],
        moe_router_topk=model["top_k"],
        moe_token_dispatcher_type="alltoall",
        moe_enable_routing_replay=True,
        moe_router_fusion=False,
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=grouped,
        expert_model_parallel_size=group.world,
        use_cpu_initialization=not cuda,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=F.silu,
    )
    if "moe_router_dtype" in fields:
        kwargs["moe_router_dtype"] = "fp32"  # NOTE: as moe_perf's proxies (test_cases.py, d98e8a6)
    if model["shared_experts"]:
        kwargs["moe_shared_expert_intermediate_size"] = model["shared_ffn"] * model["shared_experts"]
    if dispatcher == "flex-deepep":
        kwargs["moe_token_dispatcher_type"] = "flex"
        if "moe_flex_dispatcher_backend" in fields:
            kwargs["moe_flex_dispatcher_backend"] = "deepep"
        else:
            kwargs["moe_enable_deepep"] = True
    RouterReplay.clear_global_router_replay_instances()
    config = TransformerConfig(**kwargs)
    spec = get_moe_module_spec(use_te=use_te, num_experts=model["num_experts"], moe_grouped_gemm=grouped)
    layer = MoELayer(config, spec.submodules).to(group.device, dtype)
    layer.relibra_note = (  # type: ignore[attr-defined]
        f"megatron-core {version}, experts {type(layer.experts).__name__}, "
        f"{'Transformer Engine' if use_te else 'no Transformer Engine'}"
    )
    return layer


# ------------------------------------------------------------------------------------------------ the parts
def part_calibration(group: Group, settings: Settings) -> dict[str, Any]:
    """(b): ``scripts/calibrate_gpu.py`` on rank 0 (its own defaults); the others wait."""
    result: dict[str, Any] = {}
    error: BaseException | None = None
    if group.rank == 0:
        try:
            with tempfile.TemporaryDirectory() as tmp:
                argv = ["--out", str(Path(tmp) / "cal.json")] + (["--dry-run"] if settings.dry_run else [])
                result = calibrate_gpu.main(argv)
        except (Exception, SystemExit) as exc:  # NOTE: re-raised after the others left the barrier
            error = exc
    dist.barrier()
    if error is not None:
        raise RuntimeError(f"scripts/calibrate_gpu.py: {type(error).__name__}: {error}") from error
    return result


def part_moe_layer(group: Group, settings: Settings, start: float) -> dict[str, Any]:
    """(a): every (model, implementation, workload) that runs here; the others with their reasons."""
    dtype = torch.float32 if settings.dry_run else torch.bfloat16
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    impls = (("torch", "alltoall"), ("megatron", "alltoall"), ("megatron", "flex-deepep"))
    for model in settings.models:
        workloads: list[Workload] = []
        try:
            for w in workload_routes(model, settings, group.world):
                workloads.append(w)
        except Exception as exc:  # NOTE: the workloads built so far still run; the rest are recorded
            skipped.append(_failure(f"{model['name']}/workloads after {len(workloads)}", exc))
        for impl, dispatcher in impls:
            case = f"{model['name']}/{impl}/{dispatcher}"
            if not group.agree(time.monotonic() - start < settings.budget_s):
                skipped.append({"id": case, "status": "skipped", "reason": "--budget-s spent"})
                continue
            built: tuple[Any, str, Any] | None = None
            try:
                built = _build(impl, dispatcher, model, group, dtype, settings.seed)
            except Exception as exc:  # NOTE: recorded, never silent
                skipped.append(_failure(case, exc))
            # NOTE: every rank takes the same branch, so no rank waits in a collective the others skipped
            if not group.agree(built is not None):
                if built is not None:
                    skipped.append(
                        {"id": case, "status": "failed", "reason": "another rank could not build it"}
                    )
                continue
            assert built is not None
            layer, note, bind = built
            for w in workloads:
                forward = None
                try:
                    routes = torch.as_tensor(w.routes[group.rank], device=group.device)
                    x, grad = (
                        torch.randn(
                            settings.tokens_per_gpu, model["hidden"], generator=_gen(seed + group.rank)
                        )
                        .to(group.device, dtype)
                        .requires_grad_(requires)
                        for seed, requires in ((settings.seed, True), (settings.seed + 7_919, False))
                    )
                    forward = bind(x, routes)
                except Exception as exc:  # NOTE: recorded with its reason
                    skipped.append(_failure(f"{case}/{w.name}", exc))
                if not group.agree(forward is not None):
                    if forward is not None:
                        why = "failed on another rank"
                        skipped.append({"id": f"{case}/{w.name}", "status": "failed", "reason": why})
                    continue
                assert forward is not None
                try:
                    timing = time_fwd_bwd(group, forward, grad, settings)
                except Exception as exc:  # NOTE: recorded; a failure on one rank only can stall the others
                    skipped.append(_failure(f"{case}/{w.name}", exc))
                    continue
                rows.append(
                    {
                        "id": f"{case}/{w.name}",
                        "implementation": impl,
                        "dispatcher": dispatcher,
                        "experts": note,
                        "model": model,
                        "tokens_per_gpu": settings.tokens_per_gpu,
                        "world": group.world,
                        "dtype": str(dtype).removeprefix("torch."),
                        "workload": routing_summary(w, model["num_experts"], group.world),
                        **timing,
                    }
                )
            del layer, built, bind
            if group.device.type == "cuda":
                torch.cuda.empty_cache()
    return {
        "settings": {
            "tokens_per_gpu": settings.tokens_per_gpu,
            "warmup": settings.warmup,
            "repeats": settings.repeats,
            "statistic": "median over the timed iterations of the slowest rank's time",
            "pre_gemm": PRE_GEMM if group.device.type == "cuda" else None,
            "skews": list(settings.skews),
        },
        "rows": rows,
        "skipped": skipped,
    }


def _build(
    impl: str, dispatcher: str, model: dict[str, Any], group: Group, dtype: torch.dtype, seed: int
) -> tuple[Any, str, Callable[[torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]]:
    """The layer, a note on its experts, and ``bind(x [T, H], routes [T, k])`` -> the forward to time
    (the routes are handed to the layer there, outside the timed region)."""
    if impl == "torch":
        layer = TorchMoELayer(model, group, dtype, seed)
        return layer, layer.ffn_note, lambda x, r: functools.partial(layer, x, r)
    layer = megatron_layer(model, dispatcher, group, dtype, seed)
    replay = getattr(layer.router, "router_replay", None)
    if replay is None:
        raise Skip("this megatron-core's router has no routing replay (moe_enable_routing_replay)")
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    def bind(x: torch.Tensor, r: torch.Tensor) -> Callable[[], torch.Tensor]:
        # NOTE: megatron-core's RouterReplay API (relibra.megatron.replay wraps the same calls for the proven
        # releases); the targets stay on the device, where the router gathers its scores at them
        replay.clear_indices()
        replay.set_target_indices(r)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        def forward() -> torch.Tensor:
            out, _ = layer(x.unsqueeze(1))  # Megatron's [S, B, H], B = 1
            return out.squeeze(1)  # type: ignore[no-any-return]

        return forward

    return layer, layer.relibra_note, bind


def _failure(case: str, exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, Skip):
        return {"id": case, "status": "skipped", "reason": str(exc)}
    tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return {"id": case, "status": "failed", "reason": tb[:600]}


def part_all_to_all(group: Group, settings: Settings) -> dict[str, Any]:
    """(c): ``all_to_all_single`` of ``B`` bytes per rank (``B / G`` to each rank), slowest rank, median."""
    if group.world < 2:
        raise Skip("one GPU visible: an all-to-all needs at least two")
    rows = []
    for nbytes in settings.a2a_bytes:
        n = max(nbytes // 4 // group.world, 1) * group.world
        src = torch.ones(n, dtype=torch.float32, device=group.device)
        dst = torch.empty_like(src)
        times = []
        for it in range(settings.warmup + settings.repeats):
            dist.barrier()
            watch = Stopwatch(group.device)
            watch.mark()
            dist.all_to_all_single(dst, src)
            watch.mark()
            if it >= settings.warmup:
                times.append(watch.spans()[0])
        t = statistics.median(group.max(times))
        sent = n * 4
        rows.append(
            {
                "bytes_per_rank": sent,
                "seconds": t,
                "algbw_bytes_per_s": sent / t,
                "busbw_bytes_per_s": sent / t * (group.world - 1) / group.world,
            }
        )
    return {
        "backend": dist.get_backend(),
        "world": group.world,
        "statistic": "median over repeats of the slowest rank; busbw = algbw (G-1)/G (nccl-tests "
        "doc/PERFORMANCE.md, alltoall)",
        "rows": rows,
    }


def executor_plans(world: int, tokens: int, seed: int) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """(static plans, moved-and-replicated plans, what they hold): 2 layers, ``4 G`` experts top-2, 2
    micro-batches of ``tokens`` per GPU, loads biased 1.5x toward rank 0's experts; the second list's last
    batch moves one expert of every GPU to the next GPU and splits the hottest expert half to a replica."""
    from relibra.executors.plan_check import check_plan
    from relibra.types import BatchPlan

    e, k, layers, mbs = 4 * world, 2, 2, 2
    shares = biased_shares(e, world, 1.5)
    load = np.zeros((mbs, layers, world, e), dtype=np.int32)
    for m in range(mbs):
        for layer in range(layers):
            for j in range(world):
                load[m, layer, j] = integer_counts(shares, tokens * k, (j + m + layer) % e)
    home = np.tile(np.arange(e) // (e // world), (layers, 1)).astype(np.int32)  # [L, E]
    total = load.sum(axis=2)  # [M, L, E]

    def at_home(h: np.ndarray) -> np.ndarray:
        a = np.zeros((mbs, layers, e, world), dtype=np.int32)
        for layer in range(layers):
            a[:, layer, np.arange(e), h[layer]] = total[:, layer]
        return a

    moved = home.copy()
    firsts = np.arange(world) * (e // world)
    moved[:, firsts] = (home[:, firsts] + 1) % world
    assign = at_home(moved)
    replicas = np.full((mbs, layers, world, 1), -1, dtype=np.int32)
    for m in range(mbs):
        for layer in range(layers):
            hot = int(np.argmax(total[m, layer]))
            gpu_load = assign[m, layer].sum(axis=0)
            gpu_load[moved[layer, hot]] = np.iinfo(np.int32).max
            to = int(np.argmin(gpu_load))
            half = int(total[m, layer, hot]) // 2
            assign[m, layer, hot, moved[layer, hot]] -= half
            assign[m, layer, hot, to] += half
            replicas[m, layer, to, 0] = hot
    none = np.zeros(0, dtype=np.int32)
    static = BatchPlan(home=home, assign=at_home(home), load=load, sample_gpu=none)
    plan = BatchPlan(home=moved, assign=assign, load=load, sample_gpu=none, replicas=replicas)
    check_plan(static, world, world, 0)
    check_plan(plan, world, world, 1)
    info = {
        "experts": e,
        "top_k": k,
        "layers": layers,
        "microbatches_per_batch": mbs,
        "tokens_per_gpu": tokens,
        "load_skew_target": 1.5,
        "moved_experts_per_layer": world,
        "replicas_per_layer": 1,
    }
    return [static], [static, plan], info


def part_executor(group: Group, settings: Settings) -> dict[str, Any]:
    """(d): ``run_batches`` on the static plan, then on static -> moved + replicated (reorder, replica
    fill); wall seconds of each call between synchronised barriers (median of ``repeats`` after one warm-up
    call), and the executor's own per-stage numbers (host-side spans on a GPU: docs/executor.md)."""
    if group.world < 2:
        raise Skip("one GPU visible: the executor's dispatch, reorder and replica fill need at least two")
    from relibra.executors.torch_executor import RunOptions, run_batches
    from relibra.executors.torch_moe import ExpertShape

    static, moving, info = executor_plans(group.world, settings.executor_tokens, settings.seed)
    out: dict[str, Any] = {
        "plans": info,
        "hidden": settings.executor_shape[0],
        "ffn": settings.executor_shape[1],
    }
    for name, plans, slots in (("static", static, 0), ("moved_replicated", moving, 1)):
        opts = RunOptions(top_k=2, shape=ExpertShape(*settings.executor_shape), replica_slots=slots, lr=0.0)
        walls, res = [], {}
        for it in range(1 + max(settings.repeats // 4, 1)):
            dist.barrier()
            _sync(group.device)
            t0 = time.perf_counter()
            res = run_batches(group.rank, group.world, plans, opts, group.device)
            _sync(group.device)
            dist.barrier()
            if it:
                walls.append(time.perf_counter() - t0)
        out[name] = {
            "batches": len(plans),
            "wall_s": statistics.median(group.max(walls)),
            "executor_moe_time_s": float(res["moe_time_s"].sum()),
            "replica_fill_wait_s": res["fill_wait_s"],
            "t_reorder_s": res["reorder_s"],
            "reorder_moved_experts": res["reorder_moved_experts"],
            "replica_buffer_bytes": res["replica_buffer_bytes"],
        }
    out["backend"] = dist.get_backend()
    out["statistic"] = (
        "wall_s: median over calls of the slowest rank's run_batches, device-synchronised (it includes "
        "building the model); the executor_* fields are the executor's own host-side spans"
    )
    return out


# ------------------------------------------------------------------------------------------------ provenance
def provenance(group: Group, settings: Settings) -> dict[str, Any]:
    dtype = torch.float32 if settings.dry_run else torch.bfloat16
    info = calibrate_gpu.provenance(group.device, settings.dry_run, dtype)
    try:  # NOTE: the installed release, without importing it (slow); the Megatron part imports it
        mc: str | None = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        mc = None
    info.update(
        command=settings.command,
        world=group.world,
        backend=dist.get_backend(),
        gpu_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        megatron_core=mc,
        transformer_engine=_optional_version("transformer_engine", "transformer-engine"),
        deep_ep=_optional_version("deep_ep", "deep_ep"),
        python=platform.python_version(),
    )
    try:
        from relibra.provenance import code_version

        info["code_version"] = code_version()
    except Exception as exc:  # NOTE: recorded with its reason
        info["code_version"] = f"unknown ({type(exc).__name__})"
    return info


# ------------------------------------------------------------------------------------------------ running
def _soft(name: str, fn: Callable[[], dict[str, Any]], group: Group, budget_left: bool) -> dict[str, Any]:
    """Run one part; its dict with ``status`` ``measured``, or ``skipped`` / ``failed`` and the reason."""
    if not group.agree(budget_left):
        return {"status": "skipped", "reason": "--budget-s spent before this part started"}
    try:
        return {"status": "measured", **fn()}
    except Exception as exc:  # NOTE: recorded in the JSON: the other parts still run
        failure = _failure(name, exc)
        if failure["status"] == "failed":
            print(
                f"[rank {group.rank}] {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True
            )
        return {"status": failure["status"], "reason": failure["reason"]}


def _hoist_calibration(doc: dict[str, Any]) -> None:
    """Move calibrate_gpu's curves and copy bandwidth to the top level, where
    ``relibra.cost.calibration.load_calibration`` reads them (``models``, ``d2d_*``)."""
    cal = doc["calibration"]
    doc["models"] = cal.pop("models", doc.get("models", {}))
    for key in ("d2d_bytes_per_s", "d2d_kind"):
        if key in cal:
            doc[key] = cal.pop(key)
    if "provenance" in cal:
        cal_prov = cal.pop("provenance")
        cal["settings"] = {k: cal_prov[k] for k in ("group", "repeats")}


def run_rank(settings: Settings, rank: int, world: int, local_rank: int) -> dict[str, Any] | None:
    """One process's share of every part; rank 0 returns the document (the others None) and writes it
    after every part (``complete`` false until the last), so a crash keeps what was measured."""
    start = time.monotonic()
    cuda = not settings.dry_run
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    timeout = timedelta(minutes=10)  # NOTE: the longest wait is the others' while rank 0 runs calibrate_gpu
    if "RANK" in os.environ:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    group = Group(rank, world, device)
    try:
        doc: dict[str, Any] = {"provenance": {**provenance(group, settings), "complete": False}}
        doc.update(
            {p: {"status": "skipped", "reason": "not reached: the run ended before this part"} for p in PARTS}
        )
        doc["models"] = {}

        def left() -> bool:
            return time.monotonic() - start < settings.budget_s

        parts: dict[str, Callable[[], dict[str, Any]]] = {
            "calibration": lambda: part_calibration(group, settings),
            "moe_layer": lambda: part_moe_layer(group, settings, start),
            "all_to_all": lambda: part_all_to_all(group, settings),
            "executor": lambda: part_executor(group, settings),
        }
        for name, fn in parts.items():
            if name not in settings.parts:
                doc[name] = {"status": "skipped", "reason": "not in --parts"}
                continue
            if rank == 0:
                print(f"gpu_moe_layer: {name} ({time.monotonic() - start:.0f} s)", flush=True)
            doc[name] = _soft(name, fn, group, left())
            if rank == 0:
                _hoist_calibration(doc)
                doc["provenance"]["seconds"] = round(time.monotonic() - start, 1)
                write(doc, settings.out)
        doc["provenance"]["complete"] = True
        dist.barrier()
    finally:
        if "megatron.core.parallel_state" in sys.modules:  # NOTE: only where the Megatron part set it up
            with contextlib.suppress(Exception):
                sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        dist.destroy_process_group()
    return doc if rank == 0 else None


def write(doc: dict[str, Any], out: Path) -> None:
    from relibra.atomic import atomic_write

    text = json.dumps(doc, indent=1, default=_json_default) + "\n"
    atomic_write(out, lambda f: f.write(text.encode()))


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    settings = parse(args)
    world = int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else None
    if world is None:
        wanted = settings.world
        if wanted > 1:  # relaunch under torchrun: one process per GPU (or per --world on the CPU)
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={wanted}",
                str(Path(__file__).resolve()), *args,
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RELIBRA_GPU_MOE_COMMAND": settings.command}
            return subprocess.run(cmd, env=env, check=False).returncode
        world = 1
    if "RELIBRA_GPU_MOE_COMMAND" in os.environ:
        settings = dataclasses.replace(settings, command=os.environ["RELIBRA_GPU_MOE_COMMAND"])
    rank = int(os.environ.get("RANK", "0"))
    doc = run_rank(settings, rank, world, int(os.environ.get("LOCAL_RANK", "0")))
    if doc is not None:
        write(doc, settings.out)
        layer = doc["moe_layer"]
        n = len(layer.get("rows", []))
        print(
            f"wrote {settings.out}: {n} layer rows; calibration {doc['calibration']['status']}, all-to-all "
            f"{doc['all_to_all']['status']}, executor {doc['executor']['status']} "
            f"({doc['provenance']['seconds']} s)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
