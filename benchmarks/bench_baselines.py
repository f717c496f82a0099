"""Every planner side by side: skewness and simulated throughput on synthetic presets and the OLMoE trace.

Usage (from the repository root):
``PYTHONPATH=. python benchmarks/bench_baselines.py [--full] [--presets reasoning,mixed] [--no-trace]``.
Default: OLMoE-1B-7B shape on 2 nodes x 8 GPUs, 3 batches of 64 samples up to 2048 tokens per preset, and
the real OLMoE prefill counts (../shared/traces/olmoe-prefill-counts, skipped when absent). ``--full``:
Qwen3-30B-A3B on 4 x 8 GPUs, 4 batches of 256 samples up to 8192 tokens (long on a laptop).
Planners: Megatron-LM, Balanced, EPLB+ (hierarchical / global, oracle / history), LPLB+ (exact LP and the
4-iteration interior point), PopFetcher, UltraEP, LLEP, and ReLibra where its config exists.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from _common import timed_simulation
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

from experiments.config.build import build_model
from experiments.config.spec import build_spec
from relibra.trace.importers import load_olmoe_prefill_counts
from relibra.types import SampleCounts

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "experiments" / "conf"
TRACE = ROOT.parent / "shared" / "traces" / "olmoe-prefill-counts"

# (label, planner config, extra overrides)
PLANNERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("megatron", "megatron", ()),
    ("balanced", "balanced", ()),
    ("eplb+ hier oracle", "eplb", ()),
    ("eplb+ global oracle", "eplb_global", ()),
    ("eplb hier history", "eplb_history", ()),
    ("eplb global history", "eplb_global", ("planner.load_mode=history",)),
    ("lplb+ exact", "lplb", ()),
    ("lplb+ ipm4", "lplb", ("planner.solver=ipm",)),
    ("popfetcher", "popfetcher", ()),
    ("ultraep", "ultraep", ()),
    ("llep", "llep", ()),
    ("relibra", "relibra", ()),
)


def _rebatch(counts: SampleCounts, samples_per_batch: int) -> SampleCounts:
    """Cut a one-batch trace into batches of ``samples_per_batch`` samples (the tail joins the last)."""
    n = counts.num_samples
    offsets = [*range(0, n - samples_per_batch + 1, samples_per_batch), n]
    return SampleCounts(
        counts=counts.counts,
        tokens=counts.tokens,
        batch_offsets=np.asarray(sorted(set(offsets)), dtype=np.int64),
        top_k=counts.top_k,
        sample_domain=counts.sample_domain,
        domain_names=counts.domain_names,
        meta=counts.meta,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="Qwen3-30B-A3B shape on 4 x 8 GPUs, larger batches")
    ap.add_argument("--presets", default="reasoning,mixed", help="comma-separated synthetic presets")
    ap.add_argument("--no-trace", action="store_true", help="skip the real OLMoE trace")
    args = ap.parse_args()
    scale = (
        [
            "model=qwen3-30b-a3b",
            "cluster.nodes=4",
            "trace.samples_per_batch=256",
            "trace.max_tokens=8192",
            "trace.num_batches=4",
        ]
        if args.full
        else [
            "model=olmoe-1b-7b",
            "cluster.nodes=2",
            "trace.samples_per_batch=64",
            "trace.max_tokens=2048",
            "trace.num_batches=3",
        ]
    )
    have = {p.stem for p in (CONF / "planner").glob("*.yaml")}
    datasets: list[tuple[str, list[str]]] = [(p, [f"trace.preset={p}"]) for p in args.presets.split(",")]
    if not args.no_trace and TRACE.is_dir():
        datasets.append(("olmoe-prefill (real)", ["model=olmoe-1b-7b", "cluster.nodes=2"]))

    table = Table(title="Baselines (simulated; skewness = max/mean per-GPU compute tokens)")
    for col in (
        "dataset",
        "planner",
        "step s",
        "tokens/s",
        "vs megatron",
        "skew mean",
        "skew p90",
        "compute s",
        "comm s",
        "reorder s",
        "plan s",
        "notes",
    ):
        table.add_column(col, justify="right")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for dataset, overrides in datasets:
            base_thr = None
            for label, conf, extra in PLANNERS:
                if conf not in have:
                    continue
                cfg = compose(config_name="config", overrides=[*scale, *overrides, f"planner={conf}", *extra])
                counts = None
                if dataset.startswith("olmoe"):
                    counts = _rebatch(
                        load_olmoe_prefill_counts(TRACE, top_k=build_model(build_spec(cfg)).top_k), 50
                    )
                res, wall = timed_simulation(cfg, counts)
                m = res.metrics
                thr = m["throughput_tokens_per_s"]
                base_thr = thr if label == "megatron" else base_thr
                notes = []
                for key, fmt in (
                    ("lp_gap_mean", "gap {:.2%}"),
                    ("prediction_hit_rate", "hit {:.2f}"),
                    ("redundant_experts_per_gpu", "mem {:.0f} exp/GPU"),
                ):
                    if key in m:
                        notes.append(fmt.format(m[key]))
                table.add_row(
                    dataset,
                    label,
                    f"{m['step_time_s']:.4f}",
                    f"{thr:.3g}",
                    f"{thr / base_thr:.3f}" if base_thr else "",
                    f"{m['skew_mean']:.3f}",
                    f"{m['skew_p90']:.3f}",
                    f"{m['t_compute_s']:.4f}",
                    f"{m['t_comm_s']:.4f}",
                    f"{m['t_reorder_s']:.4f}",
                    f"{m['plan_time_s']:.3f}",
                    ", ".join(notes) + f" (sim {wall:.1f}s)",
                )
    Console(width=240).print(table)


if __name__ == "__main__":
    main()
