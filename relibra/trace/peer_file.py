"""Read the token-imbalance benchmark's own trace files (Megatron-LM PR #7488, "trace v1"), verified.

Source: ``benchmarks/moe/token_imbalance/trace.py`` (``save_trace``, ``load_trace``, ``_validate_semantics``)
of NVIDIA/Megatron-LM PR #7488 at ``241aa13a``, read and re-written. A trace is a folder::

    manifest.json                 schema_version 1, seed, step_id, logical_num_tokens, num_experts, topk,
                                  world_size, workload_id, workload_checksum, tensors{name: file, sha256,
                                  shape, dtype}
    tensors/token_ids.pt          int64 [T, K]
    tensors/gates.pt              float32 [T, K] (rows sum to 1)
    tensors/source_rank.pt        int32 [T] (the rank that contributed the row)
    tensors/expert_ids.pt         int64 [T, K] (equal to token_ids)

:func:`read_peer_trace` refuses, with one :class:`PeerTraceError` naming the file or manifest field, every
file the peer's loader refuses (schema, a missing field or file, a tensor whose sha256 differs from the
manifest's, shape, dtype, repeated or out-of-range experts, bad gates or source ranks, no tokens) and, beyond
it, every file it cannot verify: the routes and gates must equal :func:`relibra.trace.peer.routes_for_step`
of the manifest's ``(workload_id, seed, step_id)``, and ``workload_checksum`` must equal the peer's
fingerprint over ``steps`` steps at EP ``ep`` (neither is in the manifest: the peer's defaults, 1 step and
``ep = world_size``, unless given). Tensors are read with ``torch.load(weights_only=True)`` (no pickle of
arbitrary objects), as the peer reads them.

Usage::

    python -m relibra.trace.peer_file TRACE_DIR --model qwen3-30b-a3b --out trace.npz [--steps S] [--ep G]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relibra.trace.format import RoutingTrace, save_trace
from relibra.trace.peer import WORKLOADS, ModelShape, fingerprint, model_shape, routes_for_step

__all__ = [
    "SCHEMA_VERSION",
    "TENSORS",
    "PeerTrace",
    "PeerTraceError",
    "main",
    "read_peer_trace",
    "to_routing_trace",
]

SCHEMA_VERSION = 1
"""The peer's ``trace.py``: ``SCHEMA_VERSION``."""
TENSORS = {"token_ids": "int64", "gates": "float32", "source_rank": "int32", "expert_ids": "int64"}
"""The peer's ``TENSOR_FILES`` and the dtype its ``save_trace`` writes each in."""
REQUIRED = ("seed", "logical_num_tokens", "num_experts", "topk", "world_size", "workload_checksum", "tensors")
"""Manifest fields the peer's ``load_trace`` requires; ``workload_id`` and ``step_id`` are needed here too
(to regenerate the routes)."""
GATE_TOLERANCE = 1e-4
"""Gate rows must sum to 1 within this (absolute and relative; the peer's ``torch.allclose`` tolerances)."""


class PeerTraceError(ValueError):
    """A peer trace folder is malformed or cannot be verified; the message names the file or field."""


@dataclass(frozen=True)
class PeerTrace:
    """A verified peer trace."""

    manifest: dict[str, Any]
    """The manifest as read."""
    expert_ids: np.ndarray
    """int64 [T, K]: each row's experts."""
    gates: np.ndarray
    """float32 [T, K]: each row's gates."""
    source_rank: np.ndarray
    """int32 [T]: the rank each row came from."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _int_field(man: dict[str, Any], key: str, least: int) -> int:
    value = man[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PeerTraceError(f"manifest.json field {key!r}: must be an integer >= {least}, got {value!r}")
    return value


def _manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    if not folder.is_dir():
        raise PeerTraceError(f"{folder}: not a folder (a peer trace is a folder holding manifest.json)")
    if not path.is_file():
        raise PeerTraceError(f"{path}: missing (a peer trace folder holds manifest.json and tensors/)")
    try:
        man = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise PeerTraceError(f"{path}: not readable JSON ({err})") from err
    if not isinstance(man, dict):
        raise PeerTraceError(f"{path}: must hold a JSON object, got {type(man).__name__}")
    if man.get("schema_version") != SCHEMA_VERSION:
        raise PeerTraceError(
            f"{path}: unsupported schema_version {man.get('schema_version')!r}, expected {SCHEMA_VERSION}"
        )
    missing = [key for key in (*REQUIRED, "workload_id", "step_id") if key not in man]
    if missing:
        raise PeerTraceError(f"{path}: missing required field(s) {missing}")
    if not isinstance(man["tensors"], dict):
        raise PeerTraceError(f"{path}: field 'tensors' must be an object")
    return man


def _tensor(folder: Path, man: dict[str, Any], name: str) -> np.ndarray:
    entry = man["tensors"].get(name)
    if not isinstance(entry, dict) or not {"file", "sha256", "shape", "dtype"} <= set(entry):
        raise PeerTraceError(
            f"manifest.json field tensors.{name}: missing, or without file, sha256, shape, dtype"
        )
    path = folder / str(entry["file"])
    if not path.resolve().is_relative_to(folder.resolve()) or not path.is_file():
        raise PeerTraceError(f"{path}: tensor file {name!r} missing (or outside the trace folder)")
    if _sha256(path) != entry["sha256"]:
        raise PeerTraceError(
            f"{path}: checksum mismatch: its sha256 differs from manifest tensors.{name}.sha256"
        )
    try:
        value = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # NOTE: torch.load raises many types (pickle, zip, EOF, runtime) for a bad file
        raise PeerTraceError(
            f"{path}: cannot be loaded as a plain tensor ({type(err).__name__}: {err})"
        ) from err
    if not isinstance(value, torch.Tensor):
        raise PeerTraceError(f"{path}: holds {type(value).__name__}, not a tensor")
    if list(value.shape) != list(entry["shape"]) or str(value.dtype).removeprefix("torch.") != entry["dtype"]:
        raise PeerTraceError(
            f"{path}: shape {list(value.shape)} dtype {value.dtype} disagree with manifest tensors.{name} "
            f"({entry['shape']}, {entry['dtype']})"
        )
    if entry["dtype"] != TENSORS[name]:
        raise PeerTraceError(f"{path}: dtype {entry['dtype']}, the peer writes {name} as {TENSORS[name]}")
    return value.numpy()


def _semantics(man: dict[str, Any], ids: np.ndarray, gates: np.ndarray, src: np.ndarray) -> None:
    tokens, num_e, k = (_int_field(man, key, 1) for key in ("logical_num_tokens", "num_experts", "topk"))
    world = _int_field(man, "world_size", 1)
    if ids.ndim != 2 or ids.shape != (tokens, k):
        raise PeerTraceError(
            f"expert_ids: shape {ids.shape}, expected [logical_num_tokens={tokens}, topk={k}]"
        )
    if gates.shape != ids.shape or src.shape != (tokens,):
        raise PeerTraceError(
            f"gates {gates.shape} / source_rank {src.shape}: must match expert_ids {ids.shape}"
        )
    if ids.min() < 0 or ids.max() >= num_e:
        raise PeerTraceError(f"expert_ids: ids {ids.min()}..{ids.max()} outside [0, num_experts={num_e})")
    ordered = np.sort(ids, axis=1)
    if k > 1 and np.any(ordered[:, 1:] == ordered[:, :-1]):
        raise PeerTraceError("expert_ids: a row repeats an expert in its top-k slots (they must be distinct)")
    if not np.all(np.isfinite(gates)) or np.any(gates < 0):
        raise PeerTraceError("gates: NaN, Inf or negative values")
    if not np.allclose(gates.sum(axis=1), 1.0, atol=GATE_TOLERANCE, rtol=GATE_TOLERANCE):
        raise PeerTraceError("gates: rows do not sum to 1")
    if src.min() < 0 or src.max() >= world:
        raise PeerTraceError(f"source_rank: ranks {src.min()}..{src.max()} outside [0, world_size={world})")


def read_peer_trace(folder: str | Path, *, steps: int = 1, ep: int | None = None) -> PeerTrace:
    """Read and verify the peer trace in ``folder`` (module doc); raises :class:`PeerTraceError`.

    ``steps``, ``ep``: the run's ``--steps`` and ``--ep`` the checksum covers (default: the peer's ``--steps``
    default 1 and the manifest's ``world_size``).
    """
    folder = Path(folder)
    man = _manifest(folder)
    arrays = {name: _tensor(folder, man, name) for name in TENSORS}
    ids, gates, src = arrays["expert_ids"], arrays["gates"], arrays["source_rank"]
    if arrays["token_ids"].shape != ids.shape or not np.array_equal(arrays["token_ids"], ids):
        raise PeerTraceError("token_ids and expert_ids disagree (the peer writes them equal)")
    _semantics(man, ids, gates, src)
    workload = man["workload_id"]
    if workload not in WORKLOADS:
        raise PeerTraceError(
            f"manifest.json field 'workload_id' {workload!r}: not one of W0-W7, cannot be verified"
        )
    seed, step = man["seed"], _int_field(man, "step_id", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PeerTraceError(f"manifest.json field 'seed': must be an integer, got {seed!r}")
    num_e, k, tokens = man["num_experts"], man["topk"], man["logical_num_tokens"]
    want_ids, want_gates = routes_for_step(workload, num_e, k, tokens, step, seed)
    if not (np.array_equal(ids, want_ids) and np.array_equal(gates, want_gates)):
        raise PeerTraceError(
            f"expert_ids/gates: not the routes of {workload} seed {seed} step {step} "
            f"(relibra.trace.peer.routes_for_step); the file cannot be verified"
        )
    ep = man["world_size"] if ep is None else ep
    if fingerprint(workload, num_e, k, tokens, steps, seed, ep) != man["workload_checksum"]:
        raise PeerTraceError(
            f"manifest.json field 'workload_checksum' {man['workload_checksum']!r}: checksum failed against "
            f"the peer's fingerprint over {steps} step(s) at EP {ep} (give the run's --steps and --ep)"
        )
    return PeerTrace(manifest=man, expert_ids=ids, gates=gates, source_rank=src)


def to_routing_trace(peer: PeerTrace, model: ModelShape) -> RoutingTrace:
    """One batch (the manifest's step); one sample per source rank present (its rows in file order); the
    routes on every MoE layer of ``model``, whose experts and top-k must be the trace's."""
    man = peer.manifest
    if (man["num_experts"], man["topk"]) != (model.num_experts, model.top_k):
        raise PeerTraceError(
            f"manifest num_experts={man['num_experts']} topk={man['topk']} but model {model.name} has "
            f"{model.num_experts} experts, top-k {model.top_k}"
        )
    order = np.argsort(peer.source_rank, kind="stable")
    ranks, lengths = np.unique(peer.source_rank, return_counts=True)
    rows = peer.expert_ids[order].astype(np.int16)
    experts = np.ascontiguousarray(
        np.broadcast_to(rows[:, None, :], (rows.shape[0], model.num_moe_layers, rows.shape[1]))
    )
    return RoutingTrace(
        experts=experts,
        sample_offsets=np.r_[0, np.cumsum(lengths)].astype(np.int64),
        batch_offsets=np.array([0, ranks.size], dtype=np.int64),
        meta={
            "num_experts": model.num_experts,
            "top_k": model.top_k,
            "num_layers": model.num_moe_layers,
            "model": model.name,
            "source": "megatron-lm-pr7488-trace-v1",
            "dataset": man["workload_id"],
            "peer": {
                "workload": man["workload_id"],
                "seed": man["seed"],
                "step_id": man["step_id"],
                "world_size": man["world_size"],
                "source_ranks": ranks.tolist(),
                "checksum": man["workload_checksum"],
            },
        },
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: exit status 0, or 2 with one message (a malformed file, a failed checksum, a bad option)."""
    ap = argparse.ArgumentParser(
        prog="python -m relibra.trace.peer_file",
        description="Verify a Megatron-LM PR #7488 trace folder and write it as a routing trace "
        "(docs/workloads.md).",
    )
    ap.add_argument("folder", type=Path, metavar="TRACE_DIR")
    ap.add_argument("--model", required=True, help="a model of experiments/conf/model")
    ap.add_argument("--out", type=Path, required=True, help="the trace file (.npz) to write")
    ap.add_argument(
        "--steps", type=int, default=1, help="the run's --steps the checksum covers (peer default 1)"
    )
    ap.add_argument(
        "--ep", type=int, default=None, help="the run's --ep (default: the manifest's world_size)"
    )
    ns = ap.parse_args(argv)
    try:
        if ns.steps < 1 or (ns.ep is not None and ns.ep < 1):
            raise PeerTraceError(f"--steps {ns.steps} / --ep {ns.ep}: must be at least 1")
        if ns.out.suffix != ".npz" or not ns.out.parent.is_dir():
            raise PeerTraceError(f"--out {ns.out}: must be an .npz file in an existing folder")
        shape = model_shape(ns.model)
        trace = to_routing_trace(read_peer_trace(ns.folder, steps=ns.steps, ep=ns.ep), shape)
    except ValueError as err:  # PeerTraceError, and model_shape's unknown model
        print(f"relibra.trace.peer_file: {ns.folder}: {err}", file=sys.stderr)
        return 2
    save_trace(trace, ns.out)
    print(f"{ns.out}: {trace.meta['dataset']}, {trace.num_samples} sample(s), checksum verified")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
