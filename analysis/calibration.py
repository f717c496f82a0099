"""Calibration of the synthetic presets against real routing: ``python -m analysis.calibration``.

For each real trace found in ``../shared/traces`` (or ``--traces DIR``) and each generator preset, one
row of load-fluctuation statistics, side by side (issue 2):

- ``layer_max_mean``: per layer, max over experts / mean over experts of the whole trace's loads (mean
  over layers);
- ``mb_max_mean``: the same per (micro-batch, layer) (mean over them);
- ``hot_change``: share of consecutive micro-batch pairs (per layer) whose hottest expert differs;
- ``top8_jaccard``: Jaccard overlap of the 8 hottest experts of consecutive micro-batches;
- ``skew_static`` / ``skew_per_mb``: EP8 skewness (max_g / mean_g of per-GPU expert loads), mean over
  (micro-batch, layer), of a placement computed once from the whole trace versus one recomputed for
  each micro-batch (greedy LPT with ``E / 8`` experts per GPU in both cases).

A micro-batch is ``--samples-per-mb`` consecutive samples (default 8: one sample per GPU of an EP8
group), fewer for traces too small to give 4 micro-batches. Count-only aggregates (Qwen3 serving counts)
have no micro-batches: only ``layer_max_mean`` is filled. The per-batch plans this project builds beat a
static placement only when ``skew_static`` clearly exceeds ``skew_per_mb``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from relibra.trace.synthetic import PRESETS, generate_counts
from relibra.types import SampleCounts
from relibra.workload import microbatch_loads

__all__ = [
    "calibration_table",
    "load_stats",
    "lpt_placement",
    "main",
    "real_workloads",
    "synthetic_workloads",
]

EP = 8
TOP = 8


def lpt_placement(loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """Greedy LPT: heaviest expert first onto the least-loaded GPU that still has room (``E / G`` each).

    Args:
        loads: float or int [..., E] expert loads (any leading problem dims).
    Returns:
        int64 [..., E]: GPU of each expert.
    """
    *lead, num_experts = loads.shape
    if num_experts % num_gpus:
        raise ValueError(f"num_experts={num_experts} is not a multiple of num_gpus={num_gpus}")
    per_gpu = num_experts // num_gpus
    flat = loads.reshape(-1, num_experts).astype(np.float64)
    rows = np.arange(flat.shape[0])
    order = np.argsort(-flat, axis=-1, kind="stable")
    gpu_load = np.zeros((flat.shape[0], num_gpus))
    gpu_used = np.zeros((flat.shape[0], num_gpus), dtype=np.int64)
    home = np.empty(flat.shape, dtype=np.int64)
    for i in range(num_experts):
        e = order[:, i]
        g = np.argmin(np.where(gpu_used < per_gpu, gpu_load, np.inf), axis=-1)
        home[rows, e] = g
        gpu_load[rows, g] += flat[rows, e]
        gpu_used[rows, g] += 1
    return home.reshape(*lead, num_experts)


def _skew(loads: np.ndarray, home: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 [...]: max_g / mean_g of per-GPU loads under ``home`` (both [..., E])."""
    flat = loads.reshape(-1, loads.shape[-1]).astype(np.float64)
    homes = np.broadcast_to(home, loads.shape).reshape(flat.shape)
    keys = np.arange(flat.shape[0])[:, None] * num_gpus + homes
    per_gpu = np.bincount(keys.ravel(), weights=flat.ravel(), minlength=flat.shape[0] * num_gpus)
    per_gpu = per_gpu.reshape(-1, num_gpus)
    mean = per_gpu.mean(axis=-1)
    return np.divide(per_gpu.max(axis=-1), mean, out=np.ones_like(mean), where=mean > 0).reshape(
        loads.shape[:-1]
    )


def _max_mean(loads: np.ndarray) -> np.ndarray:
    mean = loads.mean(axis=-1)
    return np.divide(loads.max(axis=-1), mean, out=np.ones_like(mean, dtype=np.float64), where=mean > 0)


def load_stats(counts: SampleCounts, samples_per_mb: int = 8, num_gpus: int = EP) -> dict[str, float]:
    """The calibration statistics of one workload (see the module doc)."""
    total = counts.counts.sum(axis=0, dtype=np.int64)  # [L, E]
    stats = {
        "samples": float(counts.num_samples),
        "tokens_per_mb": float("nan"),
        "layer_max_mean": float(_max_mean(total).mean()),
    }
    spm = min(samples_per_mb, max(1, counts.num_samples // 4))
    num_mb = counts.num_samples // spm
    if counts.meta.get("aggregate") or num_mb < 2:
        return stats | dict.fromkeys(
            ("mb_max_mean", "hot_change", "top8_jaccard", "skew_static", "skew_per_mb"), float("nan")
        )
    used = num_mb * spm
    mb = np.arange(used) // spm
    loads = microbatch_loads(counts.counts[:used], np.zeros(used, np.int32), mb, num_mb, 1)[:, :, 0, :]
    hot = loads.argmax(axis=-1)  # [M, L]
    top = np.argsort(-loads, axis=-1, kind="stable")[..., :TOP]
    member = np.zeros(loads.shape, dtype=bool)
    np.put_along_axis(member, top, True, axis=-1)
    inter = (member[1:] & member[:-1]).sum(-1)
    union = (member[1:] | member[:-1]).sum(-1)
    stats |= {
        "tokens_per_mb": float(counts.tokens[:used].sum() / num_mb),
        "mb_max_mean": float(_max_mean(loads).mean()),
        "hot_change": float((hot[1:] != hot[:-1]).mean()),
        "top8_jaccard": float((inter / union).mean()),
    }
    if counts.num_experts % num_gpus == 0:
        static = lpt_placement(total, num_gpus)  # [L, E]
        stats["skew_static"] = float(_skew(loads, static[None], num_gpus).mean())
        stats["skew_per_mb"] = float(_skew(loads, lpt_placement(loads, num_gpus), num_gpus).mean())
    else:
        stats["skew_static"] = stats["skew_per_mb"] = float("nan")
    return stats


def _shuffled(counts: SampleCounts, seed: int = 0) -> SampleCounts:
    """The samples in a random order (a mixed-domain trace's files come sorted by domain)."""
    order = np.random.default_rng(seed).permutation(counts.num_samples)
    return SampleCounts(
        counts=counts.counts[order],
        tokens=counts.tokens[order],
        batch_offsets=np.array([0, counts.num_samples], dtype=np.int64),
        top_k=counts.top_k,
        sample_domain=None if counts.sample_domain is None else counts.sample_domain[order],
        domain_names=counts.domain_names,
        meta=counts.meta,
    )


def _subset(counts: SampleCounts, domain: int) -> SampleCounts:
    assert counts.sample_domain is not None
    keep = np.flatnonzero(counts.sample_domain == domain)
    return SampleCounts(
        counts=counts.counts[keep],
        tokens=counts.tokens[keep],
        batch_offsets=np.array([0, keep.size], dtype=np.int64),
        top_k=counts.top_k,
        meta=counts.meta,
    )


def real_workloads(root: Path) -> Iterator[tuple[str, SampleCounts]]:
    """(name, counts) of every real trace present under ``root`` (``../shared/traces`` layout)."""
    from relibra.trace import importers

    loaders: list[tuple[str, Callable[[], SampleCounts]]] = []
    if (root / "olmoe-decode").is_dir():
        loaders.append(
            ("olmoe-decode", lambda: importers.load_olmoe_decode(root / "olmoe-decode").to_counts())
        )
    if (root / "olmoe-prefill-counts").is_dir():
        loaders.append(
            ("olmoe-prefill", lambda: importers.load_olmoe_prefill_counts(root / "olmoe-prefill-counts"))
        )
    if (root / "flame-moe-290m").is_dir():
        loaders.append(
            ("flame-moe-prefill", lambda: importers.load_flame_moe(root / "flame-moe-290m").to_counts())
        )
        loaders.append(
            (
                "flame-moe-decode",
                lambda: importers.load_flame_moe(root / "flame-moe-290m/decode_positions").to_counts(),
            )
        )
    mixtral = sorted((root / "mixtral-8x7b").glob("*.jsonl"))
    if mixtral:
        loaders.append(
            (
                "mixtral-8x7b",
                lambda: importers.load_mixtral_jsonl(mixtral, drop_incomplete=True)[0].to_counts(),
            )
        )
    for name in ("counts30b", "counts235b"):
        path = root / "qwen3-moe-counts" / f"{name}.json"
        if path.exists():
            loaders.append((f"qwen3-{name[6:]}-agg", lambda p=path: importers.load_qwen3_counts(p)))  # type: ignore[misc]
    for name, load in loaders:
        counts = load()
        if counts.sample_domain is not None and len(counts.domain_names) > 1:
            for d, domain in enumerate(counts.domain_names):
                yield f"{name}:{domain}", _subset(counts, d)
            yield f"{name}:all-shuffled", _shuffled(counts)
        else:
            yield name, counts


def synthetic_workloads(
    num_experts: int = 64,
    num_layers: int = 16,
    top_k: int = 8,
    samples: int = 200,
    seed: int = 0,
    max_tokens: tuple[int | None, ...] = (128, None),
) -> Iterator[tuple[str, SampleCounts]]:
    """(name, counts) of every preset, in the OLMoE shape by default, at decode-like and natural lengths."""
    for cap in max_tokens:
        for name in PRESETS:
            counts = generate_counts(name, num_experts, num_layers, top_k, 1, samples, seed, max_tokens=cap)
            yield f"synthetic:{name}" + (f"@{cap}" if cap else ""), counts


def calibration_table(
    traces: Path | None, samples_per_mb: int = 8, synthetic: bool = True, seed: int = 0
) -> pd.DataFrame:
    """One row per real trace and preset, one column per statistic (see the module doc)."""
    rows = []
    sources: list[Iterator[tuple[str, SampleCounts]]] = []
    if traces is not None and traces.is_dir():
        sources.append(real_workloads(traces))
    if synthetic:
        sources.append(synthetic_workloads(seed=seed))
    for source in sources:
        for name, counts in source:
            rows.append(
                {"workload": name, "E": counts.num_experts, "L": counts.num_layers, "k": counts.top_k}
                | load_stats(counts, samples_per_mb)
            )
    return pd.DataFrame(rows)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if np.isnan(value) else f"{value:.3f}"
    return str(value)


def _print(table: pd.DataFrame, markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(table.columns) + " |")
        print("|" + "|".join("---" if c == "workload" else "---:" for c in table.columns) + "|")
        for row in table.itertuples(index=False):
            print("| " + " | ".join(_cell(v) for v in row) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    out = Table(title="Load fluctuation: real traces vs synthetic presets (EP8 skew)")
    for col in table.columns:
        out.add_column(col, justify="left" if col == "workload" else "right")
    for row in table.itertuples(index=False):
        out.add_row(*(_cell(v) for v in row))
    Console(width=200).print(out)


def main(argv: list[str] | None = None) -> None:
    """Print the calibration table (``python -m analysis.calibration --help``)."""
    default = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
    parser = argparse.ArgumentParser(
        prog="python -m analysis.calibration", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--traces", type=Path, default=default, help=f"real traces folder (default {default})"
    )
    parser.add_argument("--samples-per-mb", type=int, default=8, help="samples per micro-batch (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-synthetic", action="store_true", help="real traces only")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table (for the docs)")
    args = parser.parse_args(argv)
    table = calibration_table(args.traces, args.samples_per_mb, not args.no_synthetic, args.seed)
    if table.empty:
        parser.error(f"nothing to compare: no traces under {args.traces} and --no-synthetic given")
    _print(table.drop(columns=["samples"]), args.markdown)


if __name__ == "__main__":
    main()
