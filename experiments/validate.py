"""The cost model beside published measurements: ``python -m experiments.validate``.

Prints one table: each published quantity, the model's value, their ratio (model / published) and whether
the quantity was a calibration input (its link rate was fitted to it) or an independent check. Sources
(each committed file under ``experiments/data`` names its origin and commit):

* DeepEP / Hybrid-EP bottleneck bandwidths (``deepep_bandwidth.json``): calibration of the achievable
  NVLink and RDMA rates (:mod:`relibra.cost.linkrates`) and checks at EP 16;
* DeepGEMM grouped-GEMM throughput (``deepgemm_grouped.json``): check of the small-count curve
  ``eff(n) / eff(8192)`` of :meth:`relibra.cost.model.CostModel.expert_time`;
* DeepSeek-V3's public training profile (``deepseek_v3_train_profile.json``, extracted from
  deepseek-ai/profile-data ``train.json`` by ``--extract-profile``): per MoE layer DeepEP dispatch and
  combine kernel times and the expert grouped GEMMs, H800, EP 64, 4096 tokens per GPU, FP8 GEMMs and
  dispatch, BF16 combine: checks.

``--end-to-end`` sets the whole simulated step beside published end-to-end training runs
(``end_to_end.json``, :mod:`experiments.end_to_end`): model / published per row and the median and worst
absolute error of the check rows, with the constants of ``experiments/conf`` (which hold the fitted ones)
and, where the file holds fitted constants, with those at 0 (before the fit). ``--end-to-end --fit``
first fits ``training.host_overhead_s`` to the calibration rows (:mod:`experiments.end_to_end_fit`) and
stores it in the data file; the grids read the value from ``experiments/conf/training/megatron.yaml`` (a
test keeps the two equal).

``--extract-profile FILE`` re-extracts the profile's numbers from the Chrome trace and prints the JSON.
``--estimate-error`` prints how far the load-based DeepEP estimate (what per-sample counts allow) is from
exact per-token routes: the real traces under ``--traces`` (default ``../shared/traces``) and synthetic
routes (independent uniform top-k; DeepEP's node-limited benchmark router).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from omegaconf import OmegaConf

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.fabric import deepep_link_tokens
from relibra.cost.linkrates import (
    BandwidthPoint,
    benchmark_routes,
    benchmark_volumes,
    fit_rates,
    load_points,
    predicted_bandwidth,
)
from relibra.cost.model import FP8_DISPATCH_VALUE_BYTES, CostModel
from relibra.cost.route_estimate import estimate_error

__all__ = ["DATA", "estimate_error_table", "extract_profile", "main", "validation_table"]

ROOT = Path(__file__).resolve().parent
DATA = ROOT / "data"
CONF = ROOT / "conf"
FP8_VALUE_BYTES = FP8_DISPATCH_VALUE_BYTES
"""DeepEP's FP8 dispatch: one byte per value plus one fp32 scale per 128 values."""
PROFILE_TOKENS = 4096
"""Tokens per GPU per micro-batch in the profile (one 4K sequence, EP 64, TP 1: its README)."""


def _hardware(name: str) -> HardwareSpec:
    conf: Any = OmegaConf.to_container(OmegaConf.load(CONF / "cluster" / f"{name}.yaml"), resolve=True)
    return HardwareSpec(**conf["hardware"])


def _model(name: str) -> ModelSpec:
    conf: Any = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"), resolve=True)
    return ModelSpec(**conf)


def _row(quantity: str, published: float, model: float, unit: str, role: str, source: str) -> dict[str, Any]:
    return {
        "quantity": quantity,
        "published": published,
        "model": model,
        "ratio": model / published if published else float("nan"),
        "unit": unit,
        "role": role,
        "source": source,
    }


def _deepep_rows(points: list[BandwidthPoint]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    vols = [benchmark_volumes(p) for p in points]
    h800 = _hardware("h800")
    hopper = _hardware("hopper")
    # The rates the cluster files carry (line rate x efficiency), not the fit itself: the table shows
    # what the suite uses; tests/experiments/test_validate.py pins the files to the fit.
    rates = {
        "H800": (
            h800.nvlink_bytes_per_s * h800.nvlink_efficiency,
            h800.nic_bytes_per_s * h800.nic_efficiency,
        ),
        "H100": (
            hopper.nvlink_bytes_per_s * hopper.nvlink_efficiency,
            hopper.nic_bytes_per_s * hopper.nic_efficiency,
        ),
    }
    rows = []
    for p, v in zip(points, vols, strict=True):
        nvl, nic = rates[p.gpu]
        dtype = "FP8" if p.value_bytes < 2 else "BF16"
        rows.append(
            _row(
                f"{p.impl} {p.gpu} EP{p.ep} {p.phase} ({dtype}) bottleneck bandwidth, {p.link}",
                p.reported_gb_s,
                predicted_bandwidth(v, nvl, nic),
                "GB/s",
                p.role,
                "DeepEP docs/legacy.md"
                if p.impl == "deepep-legacy"
                else "DeepEP hybrid-ep README_Hybrid-EP.md",
            )
        )
    return rows, fit_rates(points, vols, "H800")


def _gemm_rows() -> list[dict[str, Any]]:
    doc = json.loads((DATA / "deepgemm_grouped.json").read_text())
    hw = _hardware("h800")
    rows = []
    big = {(r["n"], r["k"]): r for r in doc["rows"] if r["layout"] == "contiguous" and r["m"] == 8192}
    for r in doc["rows"]:
        if r["m"] >= 8192:
            continue
        ref = big[(r["n"], r["k"])]
        measured = r["tflops"] / ref["tflops"]
        h = hw.gemm_half_tokens
        model = (r["m"] / (r["m"] + h)) / (ref["m"] / (ref["m"] + h))
        rows.append(
            _row(
                f"grouped GEMM eff(M={r['m']}) / eff(8192), N={r['n']} K={r['k']} ({r['layout']})",
                measured,
                model,
                "ratio",
                "check",
                "DeepGEMM README (FP8, H800)",
            )
        )
    return rows


def _profile_rows() -> list[dict[str, Any]]:
    prof = json.loads((DATA / "deepseek_v3_train_profile.json").read_text())
    model = _model("deepseek-v3")
    hw = _hardware("h800")
    # NOTE: DeepSeek-V3 trains its expert GEMMs in FP8: price them at the FP8 peak.
    hw8 = replace(hw, bf16_flops=hw.fp8_flops)
    nodes, gpn = 8, 8
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpn, hardware=hw8, dispatcher="deepep")
    cost = CostModel(cluster, model, dispatch_value_bytes=FP8_VALUE_BYTES)
    g = cluster.num_gpus
    # The profile's routing is "absolutely balanced"; DeepSeek-V3 limits a token to 4 nodes. DeepEP's
    # own benchmark router (group-limited, 4 of 8 nodes) gives both.
    point = BandwidthPoint(
        impl="deepseek-v3", gpu="H800", ep=g, phase="dispatch", value_bytes=FP8_VALUE_BYTES,
        reported_gb_s=0.0, link="rdma", role="check", router="grouped", num_experts=model.num_experts,
        topk_groups=4, tokens=PROFILE_TOKENS, hidden=model.hidden, top_k=model.top_k,
    )  # fmt: skip
    tokens = 512
    experts = benchmark_routes(point, tokens, np.random.default_rng(0))
    dest = experts // (model.num_experts // g)
    src = np.repeat(np.arange(g), tokens)
    links = {k: v * (PROFILE_TOKENS / tokens) for k, v in deepep_link_tokens(dest, src, nodes, gpn).items()}
    dispatch_s, combine_s = (float(t.mean()) for t in cost.deepep_phase_times(links))
    per_expert = PROFILE_TOKENS * g * model.top_k / model.num_experts
    experts_per_gpu = model.num_experts // g
    # expert_time is forward + backward (3x the forward FLOPs); one third is the forward (or dgrad) GEMM.
    gemm_s = float(cost.expert_time(np.array([per_expert]))[0]) * experts_per_gpu / 3.0
    src_name = "DeepSeek-V3 train.json (profile-data)"
    k = prof["kernels_us"]
    us = {"dispatch": dispatch_s * 1e6, "combine": combine_s * 1e6, "gemm": gemm_s * 1e6}
    rows = [
        _row(f"V3 {what} per MoE layer", k[key], us[kind], "us", "check", src_name)
        for what, key, kind in (
            ("fwd dispatch kernel (FP8)", "dispatch_fwd", "dispatch"),
            ("bwd dispatch kernel (FP8)", "dispatch_bwd", "dispatch"),
            ("fwd combine kernel (BF16)", "combine_fwd", "combine"),
            ("bwd combine kernel (BF16)", "combine_bwd", "combine"),
            ("fwd expert grouped GEMMs", "grouped_gemm_fwd", "gemm"),
            ("bwd dgrad grouped GEMMs", "grouped_gemm_dgrad", "gemm"),
        )
    ]  # fmt: skip
    comm = k["dispatch_fwd"] + k["dispatch_bwd"] + k["combine_fwd"] + k["combine_bwd"]
    comp = k["grouped_gemm_fwd"] + k["grouped_gemm_dgrad"]
    rows.append(
        _row(
            "V3 dispatch+combine / fwd+dgrad grouped GEMM, per MoE layer",
            comm / comp,
            2 * (dispatch_s + combine_s) / (2 * gemm_s),
            "ratio",
            "check",
            src_name,
        )
    )
    return rows


def validation_table() -> tuple[pd.DataFrame, dict[str, float]]:
    """(the table, one row per published quantity; the link rates fitted to the calibration points)."""
    deepep, fitted = _deepep_rows(load_points(DATA / "deepep_bandwidth.json"))
    rows = deepep + _gemm_rows() + _profile_rows()
    return pd.DataFrame(rows), fitted


# --------------------------------------------------------------------------- profile extraction
def _kind(name: str) -> str | None:
    if "internode::dispatch<" in name:
        return "dispatch"
    if "internode::combine<" in name:
        return "combine"
    if "m_grouped_fp8" in name:
        return "grouped_gemm"
    return None


def extract_profile(path: str | Path) -> dict[str, Any]:
    """Per-MoE-layer kernel microseconds of DeepSeek's ``train.json`` (Chrome trace, PyTorch profiler).

    Each GPU kernel is tied to the CPU annotation (``dispatch(F)``, ``combine(F)``, ``mlp(F)``,
    ``mlp(B)``, ``dispatch(B)``, ``combine(B)``) that launched it, through its launch's ``correlation``
    id; times are means over the trace's MoE layers (4 forward, 4 backward). ``dispatch(B)`` is the
    backward of the dispatch, a combine of gradients; ``combine(B)`` a dispatch of gradients.
    """
    doc = json.loads(Path(path).read_text())
    events = doc["traceEvents"]
    spans = [
        e for e in events
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "(" in e.get("name", "")
    ]  # fmt: skip
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for k in events:
        if k.get("ph") != "X" or k.get("cat") != "kernel" or _kind(k["name"]) is None:
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is None:
            continue
        for s in spans:
            if s.get("tid") == launch.get("tid") and s["ts"] <= launch["ts"] <= s["ts"] + s["dur"]:
                times[(s["name"], str(_kind(k["name"])))].append(float(k["dur"]))
    layers = len([s for s in spans if s["name"] == "mlp(F)"])

    def per_layer(span: str, kind: str) -> float:
        return float(np.sum(times[(span, kind)]) / max(layers, 1))

    return {
        "provenance": (
            "github.com/deepseek-ai/profile-data train.json (commit "
            "449602428a1b023acb8a505d4f34fef536535db6; traceName "
            "prof_ep64_tp1_varsm_hidden7168_seqlen4096, rank 0 of 64, NVIDIA H800). One DualPipe "
            "forward chunk and one backward chunk of 4 MoE layers each, overlapped; 'absolutely balanced' "
            "routing (its README). Extracted by python -m experiments.validate --extract-profile."
        ),
        "moe_layers": layers,
        "kernels_us": {
            "dispatch_fwd": per_layer("dispatch(F)", "dispatch"),
            "combine_fwd": per_layer("combine(F)", "combine"),
            "dispatch_bwd": per_layer("combine(B)", "dispatch"),
            "combine_bwd": per_layer("dispatch(B)", "combine"),
            "grouped_gemm_fwd": per_layer("mlp(F)", "grouped_gemm"),
            "grouped_gemm_dgrad": per_layer("mlp(B)", "grouped_gemm"),
        },
    }


def estimate_error_table(traces: Path) -> pd.DataFrame:
    """Per (routes, EP shape): mean, min and max over layers of estimated / exact busiest DeepEP dispatch."""
    from relibra.trace import importers

    hw = _hardware("hopper")
    cases: list[tuple[str, np.ndarray, np.ndarray, int, tuple[tuple[int, int], ...]]] = []
    if (traces / "olmoe-decode").is_dir():
        tr = importers.load_olmoe_decode(traces / "olmoe-decode")
        cases.append(("olmoe-decode", tr.experts, tr.sample_offsets, 64, ((2, 4), (4, 2), (2, 8))))
    if (traces / "flame-moe-290m").is_dir():
        tr = importers.load_flame_moe(traces / "flame-moe-290m")
        cases.append(("flame-moe-prefill", tr.experts, tr.sample_offsets, 64, ((2, 4), (4, 2))))
    from relibra.trace.synthetic import generate_trace

    for preset in ("reasoning", "mixed"):
        tr = generate_trace(preset, 128, 4, 8, 1, 64, seed=0, max_tokens=1024)
        cases.append(
            (f"synthetic {preset} (generator)", tr.experts, tr.sample_offsets, 128, ((2, 8), (4, 8)))
        )
    for router, groups in (("uniform", None), ("grouped", 4)):
        for g in (32, 64):
            point = BandwidthPoint(
                impl="synthetic", gpu="-", ep=g, phase="dispatch", value_bytes=2.0, reported_gb_s=0.0,
                link="rdma", role="check", router=router, num_experts=256, topk_groups=groups, tokens=512,
                hidden=1, top_k=8,
            )  # fmt: skip
            ex = benchmark_routes(point, 512, np.random.default_rng(0))[:, None, :]
            label = f"synthetic {router} top-8 of 256" + (" (4 nodes max)" if groups else "")
            cases.append((label, ex, np.arange(g + 1) * 512, 256, ((g // 8, 8),)))
    rows = []
    for name, experts, offsets, e, shapes in cases:
        for nodes, gpn in shapes:
            g = nodes * gpn
            m = ModelSpec(
                name=name, num_layers=1, num_moe_layers=1, hidden=2048, moe_ffn=1, num_experts=e,
                top_k=int(experts.shape[2]), num_heads=1, num_kv_heads=1, head_dim=1,
            )  # fmt: skip
            cost = CostModel(ClusterSpec(nodes=nodes, gpus_per_node=gpn, hardware=hw, dispatcher="deepep"), m)
            token_gpu = np.repeat(np.arange(len(offsets) - 1) % g, np.diff(offsets))
            df = estimate_error(experts, token_gpu, np.arange(e) // (e // g), cost, name)
            rows.append(
                {
                    "routes": name,
                    "nodes x gpus": f"{nodes} x {gpn}",
                    "layers": len(df),
                    "ratio_mean": df.ratio.mean(),
                    "ratio_min": df.ratio.min(),
                    "ratio_max": df.ratio.max(),
                    "rdma_total_ratio": df.rdma_ratio.mean(),
                    "nvlink_total_ratio": df.nvlink_ratio.mean(),
                }
            )
    return pd.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validate", description=__doc__.splitlines()[0])
    ap.add_argument("--extract-profile", metavar="TRAIN_JSON", help="print the profile's numbers as JSON")
    ap.add_argument("--estimate-error", action="store_true", help="the DeepEP estimate against exact routes")
    ap.add_argument(
        "--end-to-end", action="store_true", help="the whole step against published training runs"
    )
    ap.add_argument(
        "--data",
        metavar="JSON",
        help="with --end-to-end: the rows to simulate (default experiments/data/end_to_end.json)",
    )
    ap.add_argument(
        "--write-tables",
        metavar="DIR",
        help="with --end-to-end: also write end_to_end.md / end_to_end_errors.md (and .tex) into DIR "
        "(docs/results: the tables docs/records/validation.md embeds; then python -m analysis --write-docs)",
    )
    ap.add_argument(
        "--moe-layer",
        action="store_true",
        help="one MoE layer's forward and backward against Megatron-LM's per-layer H100 measurements "
        "(experiments/data/moe_layer.json)",
    )
    ap.add_argument(
        "--penalty",
        action="store_true",
        help="what imbalance costs: dropless vs forced-balance runs (experiments/data/penalty.json), each "
        "routing source side by side, and the force-biased routing that would reproduce each row",
    )
    ap.add_argument(
        "--sources",
        default=None,
        help="with --penalty: comma-separated routing sources (popularity, force_biased:STD); default: "
        "experiments.penalty.SOURCES",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="with --end-to-end: fit Blackwell's host overhead to the calibration rows; with --moe-layer: "
        "the isolated layer's post-sync host time; either stores it in the data file (fitted_constants)",
    )
    ap.add_argument(
        "--joint",
        action="store_true",
        help="with --moe-layer --fit: also print the diagnostic joint fit (GEMM efficiency and host time)",
    )
    default_traces = os.environ.get("RELIBRA_SHARED_TRACES", str(ROOT.parent.parent / "shared" / "traces"))
    ap.add_argument("--traces", default=default_traces, help="real traces (default ../shared/traces)")
    args = ap.parse_args(argv)
    if args.penalty:
        if args.end_to_end or args.moe_layer or args.fit or args.write_tables or args.joint:
            print("validate: --penalty goes with --data and --sources only", file=sys.stderr)
            return 2
        return _penalty(Path(args.data) if args.data else None, args.sources)
    if args.sources:
        print("validate: --sources goes with --penalty", file=sys.stderr)
        return 2
    if args.moe_layer:
        if args.end_to_end or args.write_tables:
            print("validate: --moe-layer goes with --fit, --joint and --data only", file=sys.stderr)
            return 2
        return _moe_layer(Path(args.data) if args.data else None, args.fit, args.joint)
    if args.joint:
        print("validate: --joint goes with --moe-layer --fit", file=sys.stderr)
        return 2
    if args.end_to_end:
        return _end_to_end(Path(args.data) if args.data else None, args.fit, args.write_tables)
    if args.fit or args.data or args.write_tables:
        print(
            "validate: --fit, --data and --write-tables go with --end-to-end (or --moe-layer)",
            file=sys.stderr,
        )
        return 2
    if args.estimate_error:
        err = estimate_error_table(Path(args.traces))
        print(err.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        return 0
    if args.extract_profile:
        if not Path(args.extract_profile).is_file():
            print(f"validate: --extract-profile {args.extract_profile}: no such file", file=sys.stderr)
            return 2
        print(json.dumps(extract_profile(args.extract_profile), indent=1))
        return 0
    table, fitted = validation_table()
    with pd.option_context("display.width", 200, "display.max_colwidth", 80, "display.max_rows", 200):
        print(table.drop(columns="source").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(
        f"\nfitted achievable rates: RDMA {fitted['rdma'] / 1e9:.2f} GB/s per NIC (of 50), "
        f"NVLink (H800) {fitted['nvlink'] / 1e9:.1f} GB/s per direction (of 200)"
    )
    return 0


def _end_to_end(data: Path | None, fit: bool, write_tables: str | None) -> int:
    """``--end-to-end`` (module doc); exit status 2 with one message for a bad data file or row."""
    from experiments.end_to_end import DATA_FILE, end_to_end_table

    path = data or DATA_FILE
    try:
        if fit:
            _fit_and_store(path)
        e2e = end_to_end_table(path)
    except ValueError as exc:  # ConfigError and the roles check: the file or a row named
        print(f"validate: {exc}", file=sys.stderr)
        return 2
    cols = ["id", "role", "layout", "published", "model", "ratio", "model_unfitted", "ratio_unfitted",
            "step_time_s", "t_compute_s", "t_comm_s", "t_attention_s", "t_other_s", "t_bubble_s",
            "t_launch_s", "needs"]  # fmt: skip
    with pd.option_context("display.width", 250, "display.max_colwidth", 60):
        print(e2e.reindex(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print()
    from experiments.end_to_end_tables import end_to_end_tables

    fitted = e2e.attrs.get("fitted_constants")
    # NOTE: the check rows' errors as the generated end_to_end_errors table holds them (one definition).
    summary = end_to_end_tables(e2e, "python -m experiments.validate --end-to-end", fitted)[1]
    print(summary.title)
    print(summary.frame.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    if write_tables:
        from experiments.end_to_end_tables import write_end_to_end_tables

        command = "python -m experiments.validate --end-to-end --write-tables " + write_tables
        if data:
            command += f" --data {data}"
        for out in write_end_to_end_tables(e2e, Path(write_tables), command, fitted):
            print(f"wrote {out}")
    return 0


def _fit_and_store(path: Path) -> None:
    """Fit ``training.host_overhead_s`` to the calibration rows of ``path``, print the fit and store it in
    the file's ``fitted_constants`` (written atomically; every other field kept)."""
    from experiments.end_to_end import check_roles, load_rows
    from experiments.end_to_end_fit import FITTED, fit_host_overhead
    from relibra.atomic import atomic_write

    doc = load_rows(path)
    fitted = fit_host_overhead(doc)
    print(
        f"{FITTED} = {fitted.value:.6g} s per MoE layer, direction and micro-batch ({len(fitted.rows)} rows)"
    )
    for rid, before, after, loo in zip(
        fitted.rows, fitted.ratios_before, fitted.ratios, fitted.leave_one_out, strict=True
    ):
        print(f"  {rid}: model / published {before:.3f} at 0 -> {after:.3f}; fitted without it {loo:.6g}")
    doc["fitted_constants"] = {**(doc.get("fitted_constants") or {}), FITTED: fitted.entry()}
    check_roles(doc)
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
    print(f"stored in {path} (fitted_constants)")
    print(
        f"the grids run cluster.hardware.host_overhead_s of the Blackwell cluster yamls "
        f"(experiments/conf/cluster/b200.yaml, ...): set it to {fitted.value:.4g} there if it differs "
        "(tests/experiments/test_end_to_end_fit.py checks that they agree)\n"
    )


def _penalty(data: Path | None, sources: str | None) -> int:
    """``--penalty`` (:mod:`experiments.penalty`); exit status 2 with one message for a bad file or source."""
    from experiments.config import ConfigError
    from experiments.penalty import DATA_FILE, SOURCES, implied_std, load_penalty_rows, penalty_table

    path = data or DATA_FILE
    chosen = tuple(s.strip() for s in sources.split(",") if s.strip()) if sources is not None else SOURCES
    if not chosen:
        print("validate: --sources: no routing source given", file=sys.stderr)
        return 2
    try:
        table = penalty_table(path, chosen)
        rows = [r for r in load_penalty_rows(path)["rows"] if not r.get("needs")]
        implied = [{"id": r["id"], **implied_std(r)} for r in rows]
    except (ConfigError, KeyError, TypeError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"validate: penalty data {path}: {why}", file=sys.stderr)
        return 2
    cols = ["id", "source", "measured_penalty", "penalty", "penalty_ratio", "dropless_skew", "forced_step_s",
            "dropless_step_s", "needs"]  # fmt: skip
    with pd.option_context("display.width", 250):
        print(table.reindex(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print("\nforce-biased routing that reproduces each measured penalty (std of the per-layer bias):")
        print(pd.DataFrame(implied).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for source, part in table[table.needs == ""].groupby("source", sort=False):
        err = (part.penalty_ratio - 1.0).abs()
        print(
            f"{source}: |simulated / measured penalty - 1| median {err.median():.1%}, worst {err.max():.1%}"
        )
    return 0


def _moe_layer(data: Path | None, fit: bool, joint: bool) -> int:
    """``--moe-layer`` (:mod:`experiments.moe_layer`); exit status 2 with one message for a bad file."""
    from experiments.config import ConfigError
    from experiments.moe_layer import DATA_FILE, POST_SYNC, fit_layer, layer_table, load_layer_rows
    from relibra.atomic import atomic_write

    path = data or DATA_FILE
    try:
        doc = load_layer_rows(path)
        if fit:
            fitted = fit_layer(doc)
            print(f"{POST_SYNC} = {fitted.host_overhead_s:.6g} s per direction (the isolated layer's host "
                  f"time after the sync), at the yaml gemm_efficiency ({len(fitted.rows)} rows, "
                  f"log rms {fitted.log_rms:.3f})")  # fmt: skip
            if joint:
                both = fit_layer(doc, joint=True)
                print(f"diagnostic joint fit: gemm_efficiency {both.gemm_efficiency:.3f}, host "
                      f"{both.host_overhead_s:.6g} s (log rms {both.log_rms:.3f}); not adopted "
                      "(docs/validation.md)")  # fmt: skip
            doc["fitted_constants"] = fitted.entries()
            text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
            atomic_write(path, lambda f: f.write(text.encode()))
            print(
                f"stored in {path} (fitted_constants); a property of the measurement's setup, not a "
                "cluster yaml's host_overhead_s (docs/validation.md, 'Calibration per GPU generation')\n"
            )
        table = layer_table(path)
    except (ConfigError, KeyError, TypeError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"validate: per-layer data {path}: {why}", file=sys.stderr)
        return 2
    cols = ["id", "role", "forward_ms", "model_forward_ms", "backward_ms", "model_backward_ms", "ratio",
            "experts_ms", "shared_ms", "comm_ms", "permute_ms", "router_ms", "fp8_cast_ms",
            "host_ms"]  # fmt: skip
    with pd.option_context("display.width", 250):
        print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for role in ("calibration", "check"):
        err = (table[table.role == role].ratio - 1.0).abs()
        print(f"{role} rows: |model / measured - 1| of forward + backward: median {err.median():.1%}, "
              f"worst {err.max():.1%} ({len(err)} rows)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
