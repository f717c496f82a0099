"""Achievable NVLink and RDMA rates derived from DeepEP's published bandwidth tables.

DeepEP (``docs/legacy.md``) and Hybrid-EP (branch ``hybrid-ep``, ``docs/README_Hybrid-EP.md``) report a
*logical* bottleneck bandwidth: internode, the tokens sent to each node that holds any of their experts
(the source's own node included) times bytes per token over the kernel time; intranode, the tokens each
rank receives (its own included) over the kernel time. Neither is the bytes that cross a link, so a rate
cannot be read off the tables. This module re-creates each benchmark's routing (the benchmarks' own router:
group-limited top-k over ``|N(0, 1)| + 1`` scores for DeepEP, a uniform random top-k for Hybrid-EP; experts
placed contiguously), counts with :func:`relibra.cost.fabric.deepep_link_tokens` what crosses each link, and
turns each published number into the kernel time it implies and the per-link rate that time implies:

    t = logical tokens * bytes / reported bandwidth
    rate(link) = mean over GPUs of the busiest direction's bytes on that link / t

The calibration points of one link are averaged into its achievable rate; the ``check`` points are
predicted from those rates (the kernel time is the busier link of each GPU) and compared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

from relibra.cost.fabric import deepep_link_tokens

__all__ = [
    "BandwidthPoint",
    "LinkVolumes",
    "benchmark_routes",
    "benchmark_volumes",
    "fit_rates",
    "load_points",
    "predicted_bandwidth",
]

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class BandwidthPoint:
    """One published DeepEP bandwidth (a row of ``experiments/data/deepep_bandwidth.json``)."""

    impl: str
    """``deepep-legacy`` (V1 normal kernels) or ``hybrid-ep``."""
    gpu: str
    ep: int
    phase: str
    """``dispatch`` or ``combine``."""
    value_bytes: float
    """Bytes per hidden value (FP8 with one fp32 scale per 128 values: ``1 + 4 / 128``; BF16: 2)."""
    reported_gb_s: float
    link: str
    """The link the table names as the bottleneck: ``nvlink`` (intranode) or ``rdma``."""
    role: str
    """``calibration`` (fitted) or ``check`` (predicted)."""
    router: str
    """``grouped`` (DeepEP's group-limited top-k) or ``uniform``."""
    num_experts: int
    topk_groups: int | None
    tokens: int
    hidden: int
    top_k: int


@dataclass(frozen=True)
class LinkVolumes:
    """Tokens per source GPU (means over GPUs) of one benchmark's dispatch."""

    logical: float
    """What the table's bandwidth counts (module doc)."""
    nvlink: float
    """Busiest NVLink direction of a GPU."""
    rdma: float
    """Busiest NIC direction of a GPU."""
    nvlink_gpu: np.ndarray
    """float64 [G]: busiest NVLink direction of each GPU."""
    rdma_gpu: np.ndarray
    """float64 [G]: busiest NIC direction of each GPU."""


def load_points(path: str | PathLike[str]) -> list[BandwidthPoint]:
    """The published points of a ``deepep_bandwidth.json`` file."""
    with open(path, encoding="utf-8") as f:
        doc: dict[str, Any] = json.load(f)
    return [BandwidthPoint(**row) for row in doc["points"]]


def benchmark_routes(point: BandwidthPoint, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [G * tokens, k]: expert ids of every source's tokens (the benchmark's router), by source."""
    e, k, g = point.num_experts, point.top_k, point.ep
    t = g * tokens
    if point.router == "uniform":
        return np.argsort(rng.random((t, e)), axis=1)[:, :k]
    nodes = max(g // GPUS_PER_NODE, 1)
    scores = np.abs(rng.standard_normal((t, e))) + 1.0
    groups = point.topk_groups or nodes
    if groups < nodes:  # NOTE: DeepEP's test keeps the `groups` nodes with the highest max score.
        node_max = scores.reshape(t, nodes, -1).max(axis=-1)
        keep = np.argsort(-node_max, axis=1)[:, :groups]
        mask = np.zeros((t, nodes), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        scores = np.where(np.repeat(mask, e // nodes, axis=1), scores, -1.0)
    return np.argsort(-scores, axis=1)[:, :k]


def benchmark_volumes(point: BandwidthPoint, tokens: int = 512, seed: int = 0) -> LinkVolumes:
    """Link volumes of ``point``'s benchmark, re-created with ``tokens`` tokens per source (scaled to the
    benchmark's ``point.tokens``; the volumes are per-token means, so fewer tokens only add noise)."""
    rng = np.random.default_rng(seed)
    g = point.ep
    nodes = max(g // GPUS_PER_NODE, 1)
    gpn = min(g, GPUS_PER_NODE)
    experts = benchmark_routes(point, tokens, rng)
    dest = experts // (point.num_experts // g)
    src = np.repeat(np.arange(g), tokens)
    links = deepep_link_tokens(dest, src, nodes, gpn)
    scale = point.tokens / tokens
    hit_gpu = np.zeros((dest.shape[0], g), dtype=bool)
    hit_gpu[np.arange(dest.shape[0])[:, None], dest] = True
    if nodes == 1:
        logical = hit_gpu.sum() / g  # received tokens per rank, its own included
    else:
        logical = hit_gpu.reshape(-1, nodes, gpn).any(axis=-1).sum() / g
    nvl = np.maximum(links["nvlink_send"], links["nvlink_recv"]) * scale
    nic = np.maximum(links["nic_send"], links["nic_recv"]) * scale
    return LinkVolumes(
        logical=float(logical * scale),
        nvlink=float(nvl.mean()),
        rdma=float(nic.mean()),
        nvlink_gpu=nvl,
        rdma_gpu=nic,
    )


def implied_rate(point: BandwidthPoint, vol: LinkVolumes) -> float:
    """Bytes/s over ``point.link`` that the published number implies (module doc)."""
    t = vol.logical / (point.reported_gb_s * 1e9)  # seconds per byte-per-token
    return (vol.nvlink if point.link == "nvlink" else vol.rdma) / t


def fit_rates(points: list[BandwidthPoint], volumes: list[LinkVolumes], gpu: str) -> dict[str, float]:
    """Mean implied rate of the calibration points of each link, bytes/s: ``nvlink`` (from ``gpu``'s
    intranode points) and ``rdma`` (all internode calibration points: the NIC is the same CX7)."""
    rates: dict[str, list[float]] = {"nvlink": [], "rdma": []}
    for p, v in zip(points, volumes, strict=True):
        if p.role != "calibration" or (p.link == "nvlink" and p.gpu != gpu):
            continue
        rates[p.link].append(implied_rate(p, v))
    return {k: float(np.mean(v)) for k, v in rates.items() if v}


def predicted_bandwidth(vol: LinkVolumes, nvlink_rate: float, rdma_rate: float) -> float:
    """The logical bandwidth (GB/s, the table's unit) the rates predict: each GPU's kernel time is its
    busier link; the table's time is their mean."""
    t = np.maximum(vol.nvlink_gpu / nvlink_rate, vol.rdma_gpu / rdma_rate).mean()
    return float(vol.logical / t / 1e9)
