"""Benchmark of the input side: trace -> counts -> workload assembly, and the generator at paper scale.

Usage: ``python benchmarks/bench_workload.py [--full] [--traces DIR]``. By default the generator runs at a
reduced scale (64 samples); ``--full`` runs the paper's 512 samples x up to 8k tokens x 94 layers x 128
experts. Prints one table of best-of-``--repeat`` wall-clock times.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from relibra.trace.importers import load_olmoe_decode
from relibra.trace.synthetic import generate_counts
from relibra.workload import build_workload


def best_of(repeat: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def main() -> None:
    default = Path(__file__).resolve().parents[2] / "shared" / "traces"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=default)
    parser.add_argument("--full", action="store_true", help="generator at the paper's scale (512 samples)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = Table(title=f"workload input side (best of {args.repeat})")
    for col in ("step", "size", "seconds"):
        table.add_column(col, justify="left" if col != "seconds" else "right")

    olmoe = args.traces / "olmoe-decode"
    if olmoe.is_dir():
        t_load, trace = best_of(args.repeat, lambda: load_olmoe_decode(olmoe))
        size = f"{trace.num_tokens} tokens x {trace.num_layers} layers x top-{trace.top_k}"
        table.add_row("load OLMoE decode trace", size, f"{t_load:.3f}")
        t_counts, counts = best_of(args.repeat, trace.to_counts)
        table.add_row("trace -> per-sample counts", f"{trace.num_samples} samples", f"{t_counts:.3f}")
        for k in (1, 4):
            t_asm, work = best_of(args.repeat, partial(build_workload, counts, 16, samples_per_microbatch=k))
            table.add_row(f"assemble, 16 GPUs, K={k}", f"load {tuple(work.load.shape)}", f"{t_asm:.4f}")
    samples = 512 if args.full else 64
    t_gen, synth = best_of(
        1 if args.full else args.repeat,
        lambda: generate_counts("reasoning", 128, 94, 8, 1, samples, seed=0, max_tokens=8192),
    )
    table.add_row(
        "generate_counts reasoning E=128 L=94 k=8",
        f"{samples} samples, {int(synth.tokens.sum())} tokens, {synth.counts.nbytes / 2**20:.0f} MiB",
        f"{t_gen:.3f}",
    )
    t_asm, work = best_of(args.repeat, lambda: build_workload(synth, 64, samples_per_microbatch=1))
    table.add_row("assemble synthetic, 64 GPUs, K=1", f"load {tuple(work.load.shape)}", f"{t_asm:.3f}")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
