"""The cost model's kernels beside their published measurements: the table that ``python -m
experiments.validate`` prints (:func:`validation_table`), the profile extraction (``--extract-profile``,
:func:`extract_profile`) and the DeepEP estimate's error against exact routes (``--estimate-error``,
:func:`estimate_error_table`).

Sources (each committed file under ``experiments/data`` names its origin and commit):

* DeepEP / Hybrid-EP bottleneck bandwidths (``deepep_bandwidth.json``): calibration of the achievable
  NVLink and RDMA rates (:mod:`relibra.cost.linkrates`) and checks at EP 16;
* DeepGEMM grouped-GEMM throughput (``deepgemm_grouped.json``): check of the small-count curve
  ``eff(n) / eff(8192)`` of :meth:`relibra.cost.model.CostModel.expert_time`;
* DeepSeek-V3's public training profile (``deepseek_v3_train_profile.json``, extracted from
  deepseek-ai/profile-data ``train.json`` by ``--extract-profile``): per MoE layer DeepEP dispatch and
  combine kernel times and the expert grouped GEMMs, H800, EP 64, 4096 tokens per GPU, FP8 GEMMs and
  dispatch, BF16 combine: checks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.config.resolvers import load_option
from experiments.validation.data_files import DATA_DIR
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

__all__ = ["DATA", "estimate_error_table", "extract_profile", "validation_table"]

ROOT = Path(__file__).resolve().parents[1]
DATA = DATA_DIR
FP8_VALUE_BYTES = FP8_DISPATCH_VALUE_BYTES
"""DeepEP's FP8 dispatch: one byte per value plus one fp32 scale per 128 values."""
PROFILE_TOKENS = 4096
"""Tokens per GPU per micro-batch in the profile (one 4K sequence, EP 64, TP 1: its README)."""


def _hardware(name: str) -> HardwareSpec:
    return HardwareSpec(**load_option("cluster", name)["hardware"])


def _model(name: str) -> ModelSpec:
    return ModelSpec(**load_option("model", name))


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
