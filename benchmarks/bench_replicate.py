"""Benchmark of ReLibra's intra-batch replication (issue 5): optimality, balance, speed, buffer.

Prints four tables:

* ``optimality``: the greedy's linearised ``T_MoE`` against the MILP's incumbent and proven bound, on
  problems from the synthetic ``mixed`` preset (Qwen3-30B-A3B shape) and the real OLMoE prefill counts
  (../shared/traces, skipped when absent), EP 8, ``r = 2``;
* ``balance``: mean skewness (max / mean compute tokens per (micro-batch, layer)) of Megatron-LM,
  ``relibra_replicate_only`` and ``relibra`` for ``r = 1, 2, 4`` at EP 8, 16, 32, 64, 128 experts;
* ``speed``: median and p99 time of one (micro-batch, layer) problem at 8 GPUs per node, and one whole
  Qwen3-235B-A22B batch (94 layers x micro-batches) at EP 64;
* ``buffer``: the layer-shared buffer against a per-layer buffer and the paper's figures.

Default sizes are small (a shared 2-core machine); ``--full`` runs the issue's sizes.

    .venv/bin/python benchmarks/bench_replicate.py [--part all|optimality|balance|speed|buffer] [--full]
        [--reference FROZEN_COPY_OF_replicate.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import hardware, model  # noqa: E402

from relibra.cluster import ClusterSpec, ModelSpec  # noqa: E402
from relibra.cost.buffer_memory import PAPER_PARAM_FRACTION, buffer_footprint  # noqa: E402
from relibra.cost.model import CostModel  # noqa: E402
from relibra.cost.pricing import skewness  # noqa: E402
from relibra.planners.compose import ComposedPlanner, StaticReorderer  # noqa: E402
from relibra.planners.protocols import BatchContext, Reordering, Replication, home_assign, static_placement  # noqa: E402
from relibra.planners.replicate.greedy import (  # noqa: E402
    GreedyConfig,
    GreedyReplicator,
    linear_objective,
    replicate_greedy,
)
from relibra.planners.replicate.milp import solve_replication  # noqa: E402
from relibra.planners.replicate.milp_model import dispatch_routing  # noqa: E402
from relibra.simulator import batch_context  # noqa: E402
from relibra.trace.synthetic import generate_counts  # noqa: E402
from relibra.workload import build_workload  # noqa: E402

TRACES = REPO.parent / "shared" / "traces"
console = Console(width=150)


def cost_model(nodes: int, mdl: ModelSpec) -> CostModel:
    return CostModel(ClusterSpec(nodes, 8, hardware()), mdl)


def synthetic_context(
    mdl: ModelSpec, nodes: int, layers: int, microbatches: int, seed: int, preset: str = "mixed"
) -> BatchContext:
    """One batch of the synthetic preset: one sample per GPU per micro-batch."""
    cost = cost_model(nodes, mdl)
    g = cost.cluster.num_gpus
    counts = generate_counts(preset, mdl.num_experts, layers, mdl.top_k, 1, g * microbatches, seed)
    workload = build_workload(counts, g, samples_per_microbatch=1)
    return batch_context(counts, workload, 0, cost.cluster, mdl, cost)


def mean_skew(assign: np.ndarray) -> float:
    return float(skewness(assign.sum(axis=-2)).mean())


# ------------------------------------------------------------------------------------------ optimality
POLISH_MOVES = 32
"""``polish_moves`` of the optimality table's polished column (the greedy alone is the default)."""


def optimality_problems(full: bool, seed: int) -> list[tuple[str, np.ndarray, CostModel]]:
    """EP-8 problems of the optimality tables: synthetic `mixed` layers, then real OLMoE prefill layers."""
    per_source = 12 if full else 3
    problems: list[tuple[str, np.ndarray, CostModel]] = []
    qwen = model("qwen3-30b-a3b")
    ctx = synthetic_context(qwen, 1, per_source, 1, seed)
    problems += [(f"mixed L{l}", ctx.load[0, l], ctx.cost) for l in range(per_source)]
    olmoe_dir = TRACES / "olmoe-prefill-counts"
    if olmoe_dir.is_dir():
        olmoe_cost = cost_model(1, model("olmoe-1b-7b"))
        for domain in ("math", "coding", "general", "reasoning")[: 4 if full else 2]:
            c = np.load(olmoe_dir / f"{domain}.npz")["routing_counts"].astype(np.int64)  # [S, 16, 64]
            load = np.zeros((16, 8, 64), dtype=np.int64)
            for s in range(c.shape[0]):
                load[:, s % 8] += c[s]
            for l in np.linspace(0, 15, max(per_source // 2, 1)).astype(int):
                problems.append((f"olmoe {domain} L{l}", load[l].astype(np.int32), olmoe_cost))
    else:
        console.print(f"[yellow]{olmoe_dir} absent: OLMoE instances skipped")
    return problems


def optimality(full: bool, seed: int) -> None:
    limit = 30.0 if full else 5.0
    problems = optimality_problems(full, seed)
    table = Table(title=f"greedy vs MILP (EP 8, r = 2, SCIP {limit:.0f} s per problem, linearised T_MoE)")
    for col in (
        "instance",
        "E",
        "greedy ms",
        f"+polish({POLISH_MOVES}) ms",
        "MILP ms",
        "bound ms",
        "MILP opt",
        "gap vs MILP",
        "gap vs bound",
        "polish gap",
        "greedy / polish time ms",
    ):
        table.add_column(col, justify="right")
    gaps, gaps_bound, gaps_polish = [], [], []
    routing: dict[int, np.ndarray] = {}
    for name, x, cost in problems:
        e = x.shape[1]
        home = static_placement(1, e, 8)[0]
        replicate_greedy(x, home, cost, 2, polish_moves=POLISH_MOVES)  # compile outside the timing
        t0 = time.perf_counter()
        rep = replicate_greedy(x, home, cost, 2)
        t1 = time.perf_counter()
        pol = replicate_greedy(x, home, cost, 2, polish_moves=POLISH_MOVES)
        t2 = time.perf_counter()
        greedy = float(linear_objective(x, rep.assign, home, cost))
        polished = float(linear_objective(x, pol.assign, home, cost))
        key = id(cost)
        routing.setdefault(key, dispatch_routing(cost))
        sol = solve_replication(x, home, cost, 2, time_limit_s=limit, routing=routing[key])
        gap, gap_b = greedy / sol.objective_s - 1, greedy / sol.bound_s - 1
        gaps.append(gap)
        gaps_bound.append(gap_b)
        gaps_polish.append(polished / sol.objective_s - 1)
        table.add_row(
            name,
            str(e),
            f"{greedy * 1e3:.4f}",
            f"{polished * 1e3:.4f}",
            f"{sol.objective_s * 1e3:.4f}",
            f"{sol.bound_s * 1e3:.4f}",
            str(sol.optimal),
            f"{gap:+.3%}",
            f"{gap_b:+.3%}",
            f"{gaps_polish[-1]:+.3%}",
            f"{(t1 - t0) * 1e3:.2f} / {(t2 - t1) * 1e3:.2f}",
        )
    table.add_row(
        "mean / max", "", "", "", "", "", "", f"{np.mean(gaps):+.3%} / {np.max(gaps):+.3%}",
        f"{np.mean(gaps_bound):+.3%} / {np.max(gaps_bound):+.3%}",
        f"{np.mean(gaps_polish):+.3%} / {np.max(gaps_polish):+.3%}", "",
    )  # fmt: skip
    console.print(table)


# --------------------------------------------------------------------------------------------- balance
@dataclass(frozen=True)
class FixedReorderer:
    """Hands back one precomputed reordering (so that r = 1, 2, 4 share the same annealed placement)."""

    reordering: Reordering

    def reorder(self, ctx: BatchContext) -> Reordering:
        return self.reordering


def balance(full: bool, seed: int) -> None:
    layers, mbs = (48, 16) if full else (4, 4)
    qwen = model("qwen3-30b-a3b")
    slots = (1, 2, 4)
    table = Table(
        title=f"mean skewness and mean T_MoE (ms), Qwen3-30B-A3B shape, mixed preset, {layers} layers x "
        f"{mbs} micro-batches, 8 GPUs per node"
    )
    table.add_column("EP", justify="right")
    table.add_column("planner")
    table.add_column("acceptance")
    for r in slots:
        table.add_column(f"skew r={r}", justify="right")
    for r in slots:
        table.add_column(f"T_MoE r={r}", justify="right")
    for nodes in (1, 2, 4, 8):
        from relibra.planners.reorder.anneal import AnnealingReorderer
        from relibra.planners.reorder.config import AnnealConfig

        ctx = synthetic_context(qwen, nodes, layers, mbs, seed)
        g = ctx.num_gpus
        reo = AnnealingReorderer(AnnealConfig(workers=1)).reorder(ctx)
        static = StaticReorderer().reorder(ctx)
        for label, reordering in (("megatron", static), ("relibra_reorder_only", reo)):
            a = home_assign(ctx.load, reordering.home, g)
            t = ctx.cost.moe(ctx.load, a).t_moe.mean() * 1e3
            table.add_row(str(g), label, "-", *[f"{mean_skew(a):.3f}"] * 3, *[f"{t:.3f}"] * 3)
        for label, reordering in (("relibra_replicate_only", static), ("relibra", reo)):
            for acceptance in ("best", "compute"):
                skews, times = [], []
                for r in slots:
                    rep = GreedyReplicator(r, GreedyConfig(acceptance=acceptance))  # type: ignore[arg-type]
                    plan = ComposedPlanner(label, FixedReorderer(reordering), rep, r).plan(ctx)
                    skews.append(f"{mean_skew(plan.assign):.3f}")
                    times.append(f"{ctx.cost.moe(plan.load, plan.assign).t_moe.mean() * 1e3:.3f}")
                table.add_row(str(g), label, acceptance, *skews, *times)
        # planner=relibra_balance: both stages optimise compute balance instead of T_MoE
        bal = AnnealingReorderer(AnnealConfig(workers=1, compute_level="node", comm_weight=0.0)).reorder(ctx)
        skews, times = [], []
        for r in slots:
            rep = GreedyReplicator(r, GreedyConfig(acceptance="compute"))
            plan = ComposedPlanner("relibra_balance", FixedReorderer(bal), rep, r).plan(ctx)
            skews.append(f"{mean_skew(plan.assign):.3f}")
            times.append(f"{ctx.cost.moe(plan.load, plan.assign).t_moe.mean() * 1e3:.3f}")
        table.add_row(str(g), "relibra_balance", "compute", *skews, *times)
        console.print(f"EP {g} done", style="dim")
    console.print(table)


# ----------------------------------------------------------------------------------------------- speed
def load_reference(path: Path) -> ModuleType:
    """Import a frozen copy of replicate.py (e.g. ``git show REV:relibra/planners/replicate/greedy.py``)."""
    spec = importlib.util.spec_from_file_location("replicate_reference", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--reference {path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # numba's on-disk cache finds compiled kernels by module name
    spec.loader.exec_module(module)
    return module


def time_problems(
    fn: Callable[..., Replication], x: np.ndarray, home: np.ndarray, cost: CostModel, mode: str
):
    """Times of ``fn`` on each problem of x [P, G, E] (s), and the plans' assign [P, E, G]."""
    fn(x[0], home, cost, 2, acceptance=mode)  # warm up (compiles on a cold cache)
    times, assigns = [], []
    for p in range(x.shape[0]):
        t0 = time.perf_counter()
        rep = fn(x[p], home, cost, 2, acceptance=mode)
        times.append(time.perf_counter() - t0)
        assigns.append(rep.assign)
    return np.array(times), np.stack(assigns)


def speed(full: bool, seed: int, reference: Path | None = None) -> None:
    qwen = model("qwen3-30b-a3b")
    per_ep = 400 if full else 100
    ref = load_reference(reference) if reference is not None else None
    table = Table(
        title="greedy time per (micro-batch, layer) problem, r = 2, 8 GPUs per node, 128 experts (ms)"
        + (f"; reference: {reference}" if ref is not None else "")
    )
    for col in ("EP", "acceptance", "problems", "median", "p99"):
        table.add_column(col, justify="right")
    if ref is not None:
        for col in ("ref median", "ref p99", "speed-up (median)", "same plans", "T_MoE vs ref"):
            table.add_column(col, justify="right")
    table.add_column("replicas / GPU", justify="right")
    for nodes in (1, 2, 4, 8):
        ctx = synthetic_context(qwen, nodes, 8, max(per_ep // 8, 1), seed)
        g = ctx.num_gpus
        x = ctx.load.reshape(-1, g, 128)[:per_ep]
        home = static_placement(1, 128, g)[0]
        for mode in ("best", "comm", "compute"):
            t, assign = time_problems(replicate_greedy, x, home, ctx.cost, mode)
            t = t * 1e3
            row = [str(g), mode, str(x.shape[0]), f"{np.median(t):.3f}", f"{np.percentile(t, 99):.3f}"]
            if ref is not None:
                t_ref, assign_ref = time_problems(ref.replicate_greedy, x, home, ctx.cost, mode)
                t_ref = t_ref * 1e3
                same = int((assign == assign_ref).all(axis=(-2, -1)).sum())
                homes = np.broadcast_to(home, x.shape[:1] + home.shape)
                ratio = linear_objective(x, assign, homes, ctx.cost) / linear_objective(
                    x, assign_ref, homes, ctx.cost
                )
                row += [
                    f"{np.median(t_ref):.3f}",
                    f"{np.percentile(t_ref, 99):.3f}",
                    f"{np.median(t_ref) / np.median(t):.2f}x",
                    f"{same}/{x.shape[0]}",
                    f"{ratio.mean() - 1:+.3%}",
                ]
            reps = replicate_greedy(
                x, np.broadcast_to(home, x.shape[:1] + home.shape), ctx.cost, 2, acceptance=mode
            )  # type: ignore[arg-type]
            row.append(f"{(reps.replicas >= 0).sum() / (g * x.shape[0]):.2f}")
            table.add_row(*row)
    console.print(table)

    mbs = 16 if full else 4
    big = model("qwen3-235b-a22b")
    ctx = synthetic_context(big, 8, big.num_moe_layers, mbs, seed)
    home = static_placement(big.num_moe_layers, 128, 64)
    t0 = time.perf_counter()
    plan = ComposedPlanner("relibra_replicate_only", StaticReorderer(), GreedyReplicator(2), 2).plan(ctx)
    wall = time.perf_counter() - t0
    n = mbs * big.num_moe_layers
    skew0, skew1 = mean_skew(home_assign(ctx.load, home, 64)), mean_skew(plan.assign)
    console.print(
        f"Qwen3-235B-A22B batch, EP 64, {big.num_moe_layers} layers x {mbs} micro-batches ({n} problems), "
        f"r = 2: {wall:.2f} s ({wall / n * 1e3:.3f} ms per problem); skew {skew0:.3f} -> {skew1:.3f}"
    )


# ---------------------------------------------------------------------------------------------- buffer
def buffer(full: bool, seed: int) -> None:
    del full, seed
    table = Table(title="replica buffer per GPU, r = 2 (bf16 weights)")
    cols = ("model", "expert MiB", "layer-shared MiB", "paper MiB", "per-layer MiB", "params/GPU GiB (EP)")
    for col in (*cols, "shared %", "per-layer %", "paper %"):
        table.add_column(col, justify="right")
    for name, ep in (("qwen3-30b-a3b", 16), ("glm4.5-106b-a12b", 32), ("qwen3-235b-a22b", 64)):
        fp = buffer_footprint(model(name), 2, ep=ep)
        table.add_row(
            name,
            f"{fp.expert_bytes / 2**20:.1f}",
            f"{fp.layer_shared_bytes / 2**20:.1f}",
            f"{fp.paper_mib:.0f}",
            f"{fp.per_layer_bytes / 2**20:.0f}",
            f"{fp.per_gpu_param_bytes / 2**30:.2f} ({ep})",
            f"{fp.layer_shared_fraction:.2%}",
            f"{fp.per_layer_fraction:.1%}",
            f"{PAPER_PARAM_FRACTION[name]:.2%}",
        )
    console.print(table)


POLISH_BUDGETS = ((0, 3), (1, 2), (2, 2), (4, 2), (4, 3), (8, 2), (32, 3))
"""(polish_moves, polish_candidates) pairs of the polish table; (0, 3) is the greedy alone."""


def polish(full: bool, seed: int) -> None:
    """Mean / max gap to the MILP incumbent and time per problem for a range of polish budgets."""
    limit = 30.0 if full else 5.0
    problems = optimality_problems(full, seed)
    best = []
    for _, x, cost in problems:
        home = static_placement(1, x.shape[1], 8)[0]
        best.append(solve_replication(x, home, cost, 2, time_limit_s=limit, routing=dispatch_routing(cost)))
    title = f"polish budget (EP 8, r = 2, {len(problems)} problems, SCIP {limit:.0f} s reference)"
    table = Table(title=title)
    for col in ("polish_moves", "polish_candidates", "mean gap", "max gap", "median ms", "p90 ms"):
        table.add_column(col, justify="right")
    for moves, cands in POLISH_BUDGETS:
        gaps, times = [], []
        for (_, x, cost), sol in zip(problems, best):
            home = static_placement(1, x.shape[1], 8)[0]
            replicate_greedy(x, home, cost, 2, polish_moves=moves, polish_candidates=cands)  # compile
            t0 = time.perf_counter()
            rep = replicate_greedy(x, home, cost, 2, polish_moves=moves, polish_candidates=cands)
            times.append(time.perf_counter() - t0)
            gaps.append(float(linear_objective(x, rep.assign, home, cost)) / sol.objective_s - 1)
        table.add_row(
            str(moves), str(cands), f"{np.mean(gaps):+.3%}", f"{np.max(gaps):+.3%}",
            f"{np.median(times) * 1e3:.2f}", f"{np.percentile(times, 90) * 1e3:.2f}",
        )  # fmt: skip
    console.print(table)


PARTS = {
    "optimality": optimality,
    "polish": polish,
    "balance": balance,
    "speed": speed,
    "buffer": buffer,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=[*PARTS, "all"], default="all")
    ap.add_argument("--full", action="store_true", help="the issue's sizes (long on a small machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="speed: also time this frozen copy of replicate.py on the same problems (side by side, with "
        "a check that both give the same plans), e.g. one written by "
        "`git show HEAD:relibra/planners/replicate/greedy.py > /tmp/replicate_ref.py`",
    )
    args = ap.parse_args()
    for name, fn in PARTS.items():
        if args.part in (name, "all"):
            t0 = time.perf_counter()
            if name == "speed":
                speed(args.full, args.seed, args.reference)
            else:
                fn(args.full, args.seed)
            console.print(f"[dim]{name}: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
