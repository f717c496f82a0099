"""Inter-batch reordering: quality against exact optima, speed, and effect against Megatron-LM.

Usage: ``python benchmarks/bench_reorder.py [--full] [--sections quality,olmoe,speed,batch,effect,kernels]``.

* ``quality``: LPT, annealing and the exact MILP (SCIP) on random Dirichlet-skewed layers of 16 experts x 4
  GPUs (2 x 2) and 32 experts x 8 GPUs (2 x 4), 4 micro-batches; gap = annealing / exact - 1 where the
  MILP proved optimality.
* ``olmoe``: the same on layers of the real OLMoE prefill counts (64 experts, 16 GPUs = 2 x 8; batch
  aggregate objective so that the MILP stays tractable); needs ``../shared/traces``.
* ``speed``: seconds per layer for 128 experts at EP 8, 16, 32, 64 (8 GPUs per node), 16 micro-batches.
* ``batch``: a whole Qwen3-235B-A22B batch (94 layers, EP 64, 16 micro-batches) with 1 and 2 workers
  (default: the first 24 layers, scaled; ``--full``: all 94).
* ``kernels``: the annealer's route-class kernels against the route-table ones they stand in for on
  whole-number loads, side by side in one process (EP 64, 16 micro-batches): microseconds per swap update
  and per full state, and whether their results are identical.
* ``effect``: node-level imbalance (max / mean of per-node compute tokens, mean over micro-batch x layer)
  and the cost model's summed ``T_MoE`` (home-only) for Megatron's static placement, LPT, annealing and
  annealing + the locality round, on the synthetic presets and the OLMoE trace.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from _common import hardware, model
from rich.console import Console
from rich.table import Table

from relibra.cluster import ClusterSpec
from relibra.cost.model import CostModel
from relibra.planners.protocols import BatchContext, home_assign, static_placement
from relibra.planners.reorder.anneal import AnnealingReorderer, solve_layer
from relibra.planners.reorder.config import AnnealConfig, main_iterations
from relibra.planners.reorder.exact import milp_reorder
from relibra.planners.reorder.kernels import _apply_swap, full_state, placement_objective
from relibra.planners.reorder.links import link_routes
from relibra.planners.reorder.problem import layer_problem, lpt_placement
from relibra.planners.reorder.rail import full_state_rail, rail_swap_links
from relibra.simulator import batch_context
from relibra.trace.importers import load_olmoe_prefill_counts
from relibra.trace.synthetic import generate_counts
from relibra.types import SampleCounts
from relibra.workload import build_workload

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces"
console = Console(width=160)


def cost_for(name: str, nodes: int, gpus_per_node: int) -> CostModel:
    return CostModel(ClusterSpec(nodes, gpus_per_node, hardware()), model(name))


def random_layer(rng: np.random.Generator, mb: int, g: int, e: int, tokens: int, alpha: float) -> np.ndarray:
    """Dirichlet-skewed loads [Mb, G, E]: one routing distribution per layer, multinomial per source GPU."""
    p = rng.dirichlet(np.full(e, alpha))
    return np.stack([rng.multinomial(tokens, p, size=g) for _ in range(mb)]).astype(np.int32)


def quality_rows(
    label: str, loads: list[np.ndarray], cost: CostModel, cfg: AnnealConfig, limit: float
) -> list[list[str]]:
    """loads: per instance [Mb, G, E]. Annealing as the reorderer runs it (solve_layer) vs the MILP."""
    cluster = cost.cluster
    routes = link_routes(cluster.nodes, cluster.gpus_per_node)
    long_cfg = replace(
        cfg,
        work_per_layer=20 * cfg.work_per_layer,
        min_iterations=20 * cfg.min_iterations,
        max_iterations=20 * cfg.max_iterations,
        aggregate_warmup=10 * cfg.aggregate_warmup,
        seeds=tuple(range(8)),
    )
    gaps, lpt_gaps, bound_gaps, long_gaps, t_sa, t_ex = [], [], [], [], 0.0, 0.0
    for load in loads:
        problem = layer_problem(load, cost)
        t0 = time.perf_counter()
        home, sa, lpt = solve_layer(load, cost, cfg, routes=routes)
        t_sa += time.perf_counter() - t0
        _, long_obj, _ = solve_layer(load, cost, long_cfg, routes=routes)
        long_gaps.append(sa / min(long_obj, sa) - 1)
        ex = milp_reorder(problem, cluster, time_limit_s=limit, hint=home)
        t_ex += ex.solve_time_s
        if ex.optimal:
            gaps.append(sa / ex.objective_s - 1)
            lpt_gaps.append(lpt / ex.objective_s - 1)
        else:
            bound_gaps.append(sa / ex.bound_s - 1)  # an upper estimate of the true gap
    n = len(loads)

    def pct(v: list[float], f=np.mean) -> str:  # type: ignore[no-untyped-def]
        return f"{100 * f(v):.2f}%" if v else "-"

    return [
        [
            label,
            str(n),
            f"{len(gaps)}/{n}",
            pct(lpt_gaps),
            pct(gaps),
            pct(gaps, np.max),
            pct(bound_gaps),
            pct(long_gaps),
            f"{1e3 * t_sa / n:.1f}",
            f"{t_ex / n:.1f}",
        ]
    ]


def section_quality(full: bool, with_olmoe: bool, with_random: bool) -> None:
    cfg = AnnealConfig()
    table = Table(
        title="Reordering quality vs exact (MILP, SCIP)",
        caption="* over instances with a proven optimum; ** mean gap to the MILP bound where not proven; "
        "*** mean gap to the best of a 20x longer run with 8 seeds",
    )
    cols = (
        "instance",
        "n",
        "proven",
        "LPT gap*",
        "anneal gap*",
        "anneal max*",
        "vs bound**",
        "vs long***",
        "anneal ms",
        "MILP s",
    )
    for col in cols:
        table.add_column(col, justify="right")
    rng = np.random.default_rng(0)
    n = 10 if full else 4
    limit = 120.0 if full else 60.0
    if with_random:
        for e, nodes, gpn in ((16, 2, 2), (32, 2, 4)):
            cost = cost_for("qwen3-30b-a3b", nodes, gpn)
            g = nodes * gpn
            loads = [random_layer(rng, 4, g, e, 2048, alpha=0.5) for _ in range(n)]
            for row in quality_rows(f"random {e}x{g}, Mb=4", loads, cost, cfg, limit):
                table.add_row(*row)
    if with_olmoe:
        if not (TRACES / "olmoe-prefill-counts").is_dir():
            console.print(f"[yellow]skipping OLMoE: {TRACES} not found")
        else:
            counts = load_olmoe_prefill_counts(TRACES / "olmoe-prefill-counts")
            cost = cost_for("olmoe-1b-7b", 2, 8)
            wl = build_workload(counts, 16, samples_per_microbatch=4)
            ctx = batch_context(counts, wl, 0, cost.cluster, cost.model, cost)
            layers = range(16) if full else range(3)
            loads = [ctx.load[:, l].sum(axis=0, keepdims=True) for l in layers]
            for row in quality_rows("OLMoE 64x16, aggregate", loads, cost, cfg, 300.0 if full else 60.0):
                table.add_row(*row)
    console.print(table)


def synthetic_ctx(
    preset: str, model_name: str, nodes: int, gpn: int, samples: int, max_tokens: int, layers: int | None
) -> BatchContext:
    cost = cost_for(model_name, nodes, gpn)
    m = cost.model
    num_layers = layers or m.num_moe_layers
    counts = generate_counts(
        preset, m.num_experts, num_layers, m.top_k, 1, samples, seed=0, max_tokens=max_tokens
    )
    g = nodes * gpn
    per_mb = max(1, samples // (g * 16))  # 16 micro-batches per batch
    wl = build_workload(counts, g, samples_per_microbatch=per_mb)
    return batch_context(counts, wl, 0, cost.cluster, cost.model, cost)


def section_speed(full: bool) -> None:
    table = Table(
        title="Reordering time per layer (128 experts, 16 micro-batches, 1 process, default config)"
    )
    for col in (
        "EP",
        "nodes",
        "objective",
        "swaps per seed",
        "seeds",
        "wall ms/layer",
        "CPU ms/layer",
        "gain vs LPT*",
    ):
        table.add_column(col, justify="right")
    table.caption = "* on the per-micro-batch objective, mean over layers"
    rng = np.random.default_rng(1)
    layers = 8 if full else 3
    for g in (8, 16, 32, 64):
        nodes = g // 8
        cost = cost_for("qwen3-235b-a22b", nodes, 8)
        routes = link_routes(nodes, 8)
        loads = [random_layer(rng, 16, g, 128, 4096, alpha=0.5) for _ in range(layers)]
        solve_layer(loads[0], cost, AnnealConfig(iterations=10, aggregate_warmup=10), routes=routes)  # JIT
        rows_of = {"microbatch": 16, "aggregate": 1}
        for objective in ("microbatch", "aggregate"):
            cfg = AnnealConfig(objective=objective)
            t_total, c_total, gain = 0.0, 0.0, []
            for load in loads:
                rows = load if objective == "microbatch" else load.sum(axis=0, keepdims=True)
                t0, c0 = time.perf_counter(), time.process_time()
                home, _, _ = solve_layer(rows, cost, cfg, routes=routes)
                t_total += time.perf_counter() - t0
                c_total += time.process_time() - c0
                problem = layer_problem(load, cost)
                lpt = lpt_placement(problem.w.sum(axis=0), g)
                gain.append(
                    1
                    - placement_objective(problem, home, cost.cluster, routes)
                    / placement_objective(problem, lpt, cost.cluster, routes)
                )
            table.add_row(
                str(g),
                str(nodes),
                objective,
                f"{cfg.aggregate_warmup} agg + {main_iterations(cfg, rows_of[objective], g)}",
                str(len(cfg.seeds)),
                f"{1e3 * t_total / layers:.1f}",
                f"{1e3 * c_total / layers:.1f}",
                f"{100 * np.mean(gain):.1f}%",
            )
    console.print(table)


def section_batch(full: bool) -> None:
    layers = 94 if full else 24
    # NOTE: 1024 samples so that EP 64 gets 16 micro-batches of one sample per GPU.
    ctx = synthetic_ctx("reasoning", "qwen3-235b-a22b", 8, 8, 1024, 4096, layers)
    table = Table(
        title=f"Whole Qwen3-235B-A22B batch at EP 64 ({layers} of 94 layers, Mb={ctx.num_microbatches})",
        caption="* CPU seconds of this process (workers=1 only), a fairer measure on a busy shared machine",
    )
    for col in ("reordering", "objective", "workers", "wall s", "CPU s*", "wall x 94/L", "CPU x 94/L"):
        table.add_column(col, justify="right")
    table.add_column("gain vs start", justify="right")
    # JIT warm-up (cached on disk afterwards)
    AnnealingReorderer(AnnealConfig(iterations=10, seeds=(0,))).reorder(ctx)
    # NOTE: the incremental reordering (planner=relibra_portfolio's candidates) side by side with the paper's,
    # from Megatron-LM's static placement (the first batch), its horizon as in relibra_portfolio.yaml.
    variants = [("paper", {}), ("incremental", {"start": "previous", "horizon": 4.0})]
    for label, extra in variants:
        for objective in ("microbatch", "aggregate"):
            for workers in (1, 2):
                t0, c0 = time.perf_counter(), time.process_time()
                cfg = AnnealConfig(objective=objective, workers=workers, **extra)  # type: ignore[arg-type]
                r = AnnealingReorderer(cfg).reorder(ctx)
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                gain = 1 - r.stats["reorder_objective_s"] / r.stats["reorder_lpt_objective_s"]
                one = workers == 1
                table.add_row(
                    label,
                    objective,
                    str(workers),
                    f"{dt:.2f}",
                    f"{cpu:.2f}" if one else "-",
                    f"{dt * 94 / layers:.2f}",
                    f"{cpu * 94 / layers:.2f}" if one else "-",
                    f"{100 * gain:.1f}%",
                )
    console.print(table)


def node_imbalance(load: np.ndarray, home: np.ndarray, gpn: int) -> float:
    """Mean over (m, l) of max_n / mean_n of per-node compute tokens. load [Mb, L, G, E], home [L, E]."""
    per_expert = load.sum(axis=2).astype(np.float64)  # [Mb, L, E]
    nodes = load.shape[2] // gpn
    onehot = (home[:, :, None] // gpn) == np.arange(nodes)  # [L, E, N]
    per_node = np.einsum("mle,len->mln", per_expert, onehot)
    return float((per_node.max(-1) / np.maximum(per_node.mean(-1), 1e-9)).mean())


def t_moe(cost: CostModel, load: np.ndarray, home: np.ndarray) -> float:
    return float(cost.moe(load, home_assign(load, home, cost.cluster.num_gpus)).t_moe.sum())


def effect_rows(label: str, ctx: BatchContext) -> list[list[str]]:
    g, gpn = ctx.num_gpus, ctx.cluster.gpus_per_node
    num_layers, num_experts = ctx.counts.shape[1:]
    lin = ctx.cost.linear()
    tok = ctx.load.sum(axis=(0, 2)).astype(np.float64)
    placements = {
        "megatron": (static_placement(num_layers, num_experts, g), ctx.load),
        "LPT": (
            lpt_placement(lin.compute_s_per_token * tok + lin.compute_s_per_expert * (tok > 0), g),
            ctx.load,
        ),
    }
    r = AnnealingReorderer().reorder(ctx)
    placements["anneal"] = (r.home, ctx.load)
    rl = AnnealingReorderer(AnnealConfig(locality=True, locality_tolerance=0.1)).reorder(ctx)
    assert ctx.regroup is not None
    placements["anneal+locality"] = (rl.home, ctx.regroup(rl.sample_gpu)[0])
    base = t_moe(ctx.cost, ctx.load, placements["megatron"][0])
    rows = []
    for name, (home, load) in placements.items():
        t = t_moe(ctx.cost, load, home)
        rows.append(
            [label, name, f"{node_imbalance(load, home, gpn):.3f}", f"{1e3 * t:.2f}", f"{base / t:.3f}"]
        )
    return rows


def section_effect(full: bool) -> None:
    table = Table(title="Effect vs Megatron-LM static placement (home-only assignment, cost model T_MoE)")
    for col in ("workload", "placement", "node imbalance", "sum T_MoE ms", "speed-up"):
        table.add_column(col, justify="right")
    layers = None if full else 8
    samples = 512 if full else 128
    for preset in ("reasoning", "mixed"):
        for nodes in (2, 4):
            ctx = synthetic_ctx(preset, "qwen3-30b-a3b", nodes, 8, samples, 4096, layers)
            for row in effect_rows(f"{preset} 30B EP{nodes * 8}", ctx):
                table.add_row(*row)
    if (TRACES / "olmoe-prefill-counts").is_dir():
        counts: SampleCounts = load_olmoe_prefill_counts(TRACES / "olmoe-prefill-counts")
        cost = cost_for("olmoe-1b-7b", 2, 8)
        wl = build_workload(counts, 16, samples_per_microbatch=4)
        ctx = batch_context(counts, wl, 0, cost.cluster, cost.model, cost)
        for row in effect_rows("OLMoE EP16", ctx):
            table.add_row(*row)
    console.print(table)


def _per_call_us(fn: Callable[[int], object], calls: int) -> float:
    """Microseconds per call of ``fn(i)``, ``i`` in ``range(calls)``."""
    t0 = time.perf_counter()
    for i in range(calls):
        fn(i)
    return 1e6 * (time.perf_counter() - t0) / calls


def _kernel_rows(nodes: int, rng: np.random.Generator, calls: int) -> list[list[str]]:
    """The swap-update and full-state rows of :func:`section_kernels` for ``nodes`` nodes of 8 GPUs."""
    g = nodes * 8
    problem = layer_problem(
        random_layer(rng, 16, g, 128, 4096, alpha=0.5), cost_for("qwen3-235b-a22b", nodes, 8)
    )
    x, w, mig = problem.x, problem.w, problem.mig
    idx, cnt = link_routes(nodes, 8)
    home = lpt_placement(w.sum(axis=0), g).astype(np.int64)
    comp, link, migr = full_state(home, x, w, idx, cnt, mig)
    fast, prox = link.copy(), np.zeros(nodes + 8)
    args = [
        (int(a), int(b), int(p), int(q))
        for (a, b), (p, q) in zip(
            rng.integers(0, 128, (calls, 2)), rng.integers(0, g, (calls, 2)), strict=True
        )
    ]
    _apply_swap(*args[0], x, w, idx, cnt, mig, comp.copy(), link.copy(), migr.copy())  # JIT
    rail_swap_links(*args[0], x, 8, fast.copy(), prox)
    old = _per_call_us(lambda i: _apply_swap(*args[i], x, w, idx, cnt, mig, comp, link, migr), calls)
    new = _per_call_us(lambda i: rail_swap_links(*args[i], x, 8, fast, prox), calls)
    rows = [
        [
            str(g),
            "swap update",
            f"{old:.2f}",
            f"{new:.2f}",
            f"{old / new:.2f}",
            str(np.array_equal(link, fast)),
        ]
    ]
    reps = max(20, calls // 100)
    same = all(
        np.array_equal(a, b)
        for a, b in zip(
            full_state(home, x, w, idx, cnt, mig), full_state_rail(home, x, w, 8, mig), strict=True
        )
    )
    old = _per_call_us(lambda i: full_state(home, x, w, idx, cnt, mig), reps)
    new = _per_call_us(lambda i: full_state_rail(home, x, w, 8, mig), reps)
    rows.append([str(g), "full state", f"{old:.1f}", f"{new:.1f}", f"{old / new:.2f}", str(same)])
    return rows


def section_kernels(full: bool) -> None:
    table = Table(title="Annealer kernels, route table against route classes (whole-number loads, 1 process)")
    for col in ("EP", "operation", "route table us", "route classes us", "ratio", "identical"):
        table.add_column(col, justify="right")
    rng = np.random.default_rng(2)
    for nodes in (2, 4, 8):
        for row in _kernel_rows(nodes, rng, 20000 if full else 5000):
            table.add_row(*row)
    table.caption = "Swap updates: the same random swaps applied to two copies of one state, in sequence."
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--full", action="store_true", help="more instances, all 94 layers, paper-size batches")
    ap.add_argument("--sections", default="quality,olmoe,speed,batch,effect")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    console.print(
        "[bold]bench_reorder[/bold]: " + ", ".join(sorted(sections)) + (" (full)" if args.full else "")
    )
    if "quality" in sections or "olmoe" in sections:
        section_quality(args.full, "olmoe" in sections, "quality" in sections)
    if "speed" in sections:
        section_speed(args.full)
    if "batch" in sections:
        section_batch(args.full)
    if "effect" in sections:
        section_effect(args.full)
    if "kernels" in sections:
        section_kernels(args.full)


if __name__ == "__main__":
    main()
