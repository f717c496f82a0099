"""Read the JSON of ``scripts/gpu_moe_layer.py`` and turn its per-layer rows into rows of
``experiments/data/moe_layer.json``: ``python -m experiments.validation.gpu_measurements FILE --out
ROWS.json``, then ``python -m experiments.validate --moe-layer --data ROWS.json`` prices them beside the
measurement.

The file is checked whole before anything is written (:func:`load_measurements`): one
:class:`MeasurementError` naming the file and the field, exit status 2 from the command line. A
``--dry-run`` file holds no measurement and is refused unless ``allow_dry_run`` (the tests' use).

Each measured layer becomes one row (:func:`layer_rows`): ``id`` ``gpu/<gpu>x<G>/<measured id>``, ``role``
(``check`` unless told otherwise: a row of one's own GPU calibrates only when decided before any fit,
docs/validation.md), ``forward_ms`` / ``backward_ms`` (median of the slowest rank), ``model`` (the
ModelSpec fields run), ``tokens_per_gpu``, ``overrides`` (the cluster yaml of the GPU, one node of ``G``
GPUs, the dispatcher, bf16), and ``routing``: the workload, its realised skew and ``load`` [G][E], the
tokens each GPU sent each expert. :func:`experiments.validation.moe_layer.price_layer` prices
force-balanced routing, so only ``balanced`` rows are taken unless ``workloads="all"``; the others wait for
a pricing that reads ``routing.load``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["GPU_CLUSTERS", "MeasurementError", "layer_rows", "load_measurements", "main"]

GPU_CLUSTERS = (
    ("GB300", "gb300"),
    ("GB200", "gb200"),
    ("B300", "b300"),
    ("B200", "b200"),
    ("H800", "h800"),
    ("H100", "hopper"),
)
"""(substring of the GPU's name, cluster yaml of experiments/conf/cluster), first match wins (GB200 before
B200). Any other GPU (an H200 among them: hopper.yaml is the H100's memory) needs ``cluster`` named."""
PARTS = ("calibration", "moe_layer", "all_to_all", "executor")
STATUSES = ("measured", "skipped", "failed")
MODEL_FIELDS = (
    "name",
    "num_layers",
    "num_moe_layers",
    "hidden",
    "moe_ffn",
    "num_experts",
    "top_k",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "shared_experts",
    "shared_ffn",
    "dense_ffn",
)
"""The ``model`` fields of a per-layer row (experiments/data/moe_layer.json)."""
DISPATCHERS = {"alltoall": ("a2a", "alltoall"), "flex-deepep": ("deepep", "deepep")}
"""Measured dispatcher -> (the data file's ``backend``, ``cluster.dispatcher``)."""
PRECISIONS = {"bfloat16": "bf16"}


class MeasurementError(ValueError):
    """The file is not a valid output of scripts/gpu_moe_layer.py; the message names the file and field."""


def _fail(path: Path, field: str, problem: str) -> MeasurementError:
    return MeasurementError(f"{path}: {field}: {problem}")


def _need(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], path: Path, where: str) -> Any:
    if key not in doc:
        raise _fail(path, f"{where}{key}", "missing")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        name = " or ".join(k.__name__ for k in _as_tuple(kind))
        raise _fail(path, f"{where}{key}", f"expected {name}, got {type(value).__name__} {value!r}"[:200])
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _positive(doc: dict[str, Any], key: str, path: Path, where: str) -> float:
    value = float(_need(doc, key, (int, float), path, where))
    if not (math.isfinite(value) and value > 0):
        raise _fail(path, f"{where}{key}", f"expected a positive finite number, got {value!r}")
    return value


def _check_row(row: Any, i: int, world: int, path: Path) -> None:
    where = f"moe_layer.rows[{i}]."
    if not isinstance(row, dict):
        raise _fail(path, where.rstrip("."), f"expected an object, got {type(row).__name__}")
    _need(row, "id", str, path, where)
    _need(row, "implementation", str, path, where)
    dispatcher = _need(row, "dispatcher", str, path, where)
    if dispatcher not in DISPATCHERS:
        raise _fail(path, f"{where}dispatcher", f"{dispatcher!r} is not one of {sorted(DISPATCHERS)}")
    model = _need(row, "model", dict, path, where)
    for key in MODEL_FIELDS:
        _need(model, key, str if key == "name" else int, path, f"{where}model.")
    if int(_positive(row, "tokens_per_gpu", path, where)) != row["tokens_per_gpu"]:
        raise _fail(path, f"{where}tokens_per_gpu", "expected an integer")
    if _need(row, "world", int, path, where) != world:
        raise _fail(path, f"{where}world", f"{row['world']} differs from provenance.world {world}")
    _need(row, "dtype", str, path, where)
    _positive(row, "forward_ms", path, where)
    _positive(row, "backward_ms", path, where)
    w = _need(row, "workload", dict, path, where)
    _need(w, "name", str, path, f"{where}workload.")
    _need(w, "kind", str, path, f"{where}workload.")
    _positive(w, "skew", path, f"{where}workload.")
    load = _need(w, "load", list, path, f"{where}workload.")
    shape_ok = len(load) == world and all(
        isinstance(r, list)
        and len(r) == model["num_experts"]
        and all(isinstance(v, int) and v >= 0 for v in r)
        for r in load
    )
    if not shape_ok:
        raise _fail(
            path, f"{where}workload.load", f"expected {world} lists of {model['num_experts']} counts >= 0"
        )
    slots = row["tokens_per_gpu"] * model["top_k"]
    if any(sum(r) != slots for r in load):
        raise _fail(
            path, f"{where}workload.load", f"every GPU must route tokens_per_gpu x top_k = {slots} slots"
        )


def load_measurements(path: str | Path, allow_dry_run: bool = False) -> dict[str, Any]:
    """The file of ``scripts/gpu_moe_layer.py``, checked (module doc); :class:`MeasurementError` otherwise."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MeasurementError(f"{path}: cannot be read as JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise _fail(path, "(top level)", f"expected an object, got {type(doc).__name__}")
    prov = _need(doc, "provenance", dict, path, "")
    for key in ("gpu", "torch", "date", "command", "dtype"):
        _need(prov, key, str, path, "provenance.")
    for key in ("driver", "cuda", "megatron_core"):
        _need(prov, key, (str, type(None)), path, "provenance.")
    world = _need(prov, "world", int, path, "provenance.")
    if world < 1:
        raise _fail(path, "provenance.world", f"expected at least 1, got {world}")
    if _need(prov, "dry_run", bool, path, "provenance.") and not allow_dry_run:
        raise _fail(
            path, "provenance.dry_run", "true: written by a --dry-run (not a measurement); refusing it"
        )
    for part in PARTS:
        section = _need(doc, part, dict, path, "")
        status = _need(section, "status", str, path, f"{part}.")
        if status not in STATUSES:
            raise _fail(path, f"{part}.status", f"{status!r} is not one of {STATUSES}")
        if status != "measured" and not str(section.get("reason") or "").strip():
            raise _fail(path, f"{part}.reason", f"missing: a {status} part must say why")
    _need(doc, "models", dict, path, "")
    layer = doc["moe_layer"]
    if layer["status"] == "measured":
        rows = _need(layer, "rows", list, path, "moe_layer.")
        for i, row in enumerate(rows):
            _check_row(row, i, world, path)
        for i, entry in enumerate(_need(layer, "skipped", list, path, "moe_layer.")):
            if not (isinstance(entry, dict) and entry.get("status") in STATUSES[1:] and entry.get("reason")):
                raise _fail(
                    path, f"moe_layer.skipped[{i}]", "expected an id, a status skipped/failed and a reason"
                )
    return doc


def cluster_of(gpu: str) -> str | None:
    """The cluster yaml of a GPU name (:data:`GPU_CLUSTERS`), or None."""
    return next((cluster for key, cluster in GPU_CLUSTERS if key in gpu.upper()), None)


def layer_rows(
    doc: dict[str, Any],
    path: str | Path,
    role: str = "check",
    cluster: str | None = None,
    workloads: str = "balanced",
) -> list[dict[str, Any]]:
    """Rows of experiments/data/moe_layer.json's schema from a checked document (module doc)."""
    path = Path(path)
    if role not in ("calibration", "check"):
        raise MeasurementError(f"role {role!r}: expected calibration or check")
    if workloads not in ("balanced", "all"):
        raise MeasurementError(f"workloads {workloads!r}: expected balanced or all")
    prov = doc["provenance"]
    cluster = cluster or cluster_of(prov["gpu"])
    if cluster is None:
        raise _fail(
            path, "provenance.gpu", f"{prov['gpu']!r} has no cluster yaml here; name one (--cluster NAME of "
            "experiments/conf/cluster)",
        )  # fmt: skip
    precision = PRECISIONS.get(prov["dtype"])
    if precision is None:
        if not prov["dry_run"]:
            raise _fail(path, "provenance.dtype", f"{prov['dtype']!r}: only bfloat16 layers are priced")
        precision = "bf16"  # NOTE: a dry run's float32 stand-in, allowed only with allow_dry_run
    layer = doc["moe_layer"]
    out = []
    for row in layer.get("rows", []) if layer["status"] == "measured" else []:
        if workloads == "balanced" and row["workload"]["kind"] != "balanced":
            continue
        backend, dispatcher = DISPATCHERS[row["dispatcher"]]
        gpu = re.sub(r"[^a-z0-9]+", "-", prov["gpu"].lower().removeprefix("nvidia ")).strip("-")
        out.append(
            {
                "id": f"gpu/{gpu}x{row['world']}/{row['id']}",
                "case": row["id"],
                "role": role,
                "backend": backend,
                "implementation": row["implementation"],
                "forward_ms": row["forward_ms"],
                "backward_ms": row["backward_ms"],
                "model": {k: row["model"][k] for k in MODEL_FIELDS},
                "tokens_per_gpu": row["tokens_per_gpu"],
                "overrides": [
                    f"cluster={cluster}",
                    "cluster.nodes=1",
                    f"cluster.gpus_per_node={row['world']}",
                    f"cluster.dispatcher={dispatcher}",
                    f"cluster.precision={precision}",
                ],
                "routing": {k: row["workload"][k] for k in ("name", "kind", "skew", "load")},
            }
        )
    return out


def _describe(doc: dict[str, Any], path: Path, role: str, workloads: str) -> str:
    prov = doc["provenance"]
    return (
        f"scripts/gpu_moe_layer.py on {prov['world']} x {prov['gpu']} (driver {prov['driver']}, CUDA "
        f"{prov['cuda']}, torch {prov['torch']}, megatron-core {prov['megatron_core']}), {prov['date']}: "
        f"`{prov['command']}`; read from {path} by experiments/validation/gpu_measurements.py "
        f"(role {role}, workloads {workloads}"
        f"{', a dry run: not a measurement' if prov['dry_run'] else ''}). forward_ms / "
        "backward_ms: median over the timed iterations of the slowest rank (CUDA events, a dense GEMM "
        "queued before each)."
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.validation.gpu_measurements", description=__doc__.split("\n")[0]
    )
    ap.add_argument("file", type=Path, help="the JSON of scripts/gpu_moe_layer.py")
    ap.add_argument("--out", type=Path, required=True, help="rows for validate --moe-layer --data")
    ap.add_argument("--role", choices=("check", "calibration"), default="check")
    ap.add_argument("--cluster", help="cluster yaml name (default: from provenance.gpu)")
    ap.add_argument("--workloads", choices=("balanced", "all"), default="balanced")
    ap.add_argument("--allow-dry-run", action="store_true", help="accept a --dry-run file (tests)")
    args = ap.parse_args(argv)
    if args.cluster is not None:
        from experiments.config.presets import CONF_DIR

        conf = CONF_DIR / "cluster" / f"{args.cluster}.yaml"
        if not conf.is_file():
            print(f"gpu_measurements: --cluster {args.cluster}: no {conf}", file=sys.stderr)
            return 2
    if not args.out.parent.is_dir():
        print(f"gpu_measurements: --out {args.out}: its folder does not exist", file=sys.stderr)
        return 2
    try:
        doc = load_measurements(args.file, args.allow_dry_run)
        rows = layer_rows(doc, args.file, args.role, args.cluster, args.workloads)
    except MeasurementError as exc:
        print(f"gpu_measurements: {exc}", file=sys.stderr)
        return 2
    from relibra.atomic import atomic_write

    out = {"provenance": _describe(doc, args.file, args.role, args.workloads), "rows": rows}
    text = json.dumps(out, indent=1) + "\n"
    atomic_write(args.out, lambda f: f.write(text.encode()))
    print(f"wrote {args.out}: {len(rows)} rows (role {args.role}); price them with python -m "
          f"experiments.validate --moe-layer --data {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
