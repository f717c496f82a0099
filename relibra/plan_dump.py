"""Checks of a plan dump (``plans.npz``, written with ``dump_plans=true``; README.md, "Plan dump"): the
arrays and metadata it must hold, then every plan invariant of :mod:`relibra.invariants` on every batch."""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from typing import Any

import numpy as np

from relibra.invariants import _check_array, _fail, _first, check_assignment, sample_loads

PLAN_DUMP_ARRAYS = ("home", "sample_gpu", "sample_mb", "mb_batch", "load", "assign", "meta")
PLAN_DUMP_META_KEYS = (
    "planner",
    "nodes",
    "gpus_per_node",
    "replica_slots",
    "redundant_slots",
    "num_experts",
    "num_layers",
    "top_k",
    "trace",
)


def check_plan_dump(
    source: str | PathLike[str] | Mapping[str, Any],
    *,
    counts: np.ndarray | None = None,
    replicas_in_home_node: bool | None = None,
) -> dict[str, Any]:
    """Check a ``plans.npz`` (a path or a mapping of its arrays) against README.md, "Plan dump".

    ``counts`` int [S, L, E] (optional): the trace's per-sample counts, to check that ``load`` is their
    bincount. ``replicas_in_home_node``: None reads ``meta["replicas_in_home_node"]`` (default True).
    Returns the parsed ``meta``. Raises :class:`PlanInvariantError`.
    """
    if isinstance(source, Mapping):
        arrays = dict(source)
    else:
        with np.load(source, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    missing = [k for k in PLAN_DUMP_ARRAYS if k not in arrays]
    if missing:
        _fail("keys", f"plan dump lacks {missing}; expected arrays {list(PLAN_DUMP_ARRAYS)}")
    try:
        meta = json.loads(str(np.asarray(arrays["meta"])))
    except json.JSONDecodeError as exc:
        _fail("meta", f"plan dump meta is not JSON: {exc}")
    if not isinstance(meta, dict):
        _fail("meta", f"plan dump meta is a {type(meta).__name__}; expected a JSON object")
    lacking = [k for k in PLAN_DUMP_META_KEYS if k not in meta]
    if lacking:
        _fail("meta", f"plan dump meta lacks {lacking}; expected keys {list(PLAN_DUMP_META_KEYS)}")

    nodes, gpn = int(meta["nodes"]), int(meta["gpus_per_node"])
    g = nodes * gpn
    num_layers, num_experts = int(meta["num_layers"]), int(meta["num_experts"])
    home = _check_array("home", arrays["home"], None, 3, "plan dump")
    num_batches = home.shape[0]
    _check_array("home", home, (num_batches, num_layers, num_experts), 3, "plan dump")
    mb_batch = _check_array("mb_batch", arrays["mb_batch"], None, 1, "plan dump")
    m = mb_batch.shape[0]
    load = _check_array("load", arrays["load"], (m, num_layers, g, num_experts), 4, "plan dump")
    assign = _check_array("assign", arrays["assign"], (m, num_layers, num_experts, g), 4, "plan dump")
    sample_gpu = _check_array("sample_gpu", arrays["sample_gpu"], None, 1, "plan dump")
    sample_mb = _check_array("sample_mb", arrays["sample_mb"], sample_gpu.shape, 1, "plan dump")
    if m and (np.any(np.diff(mb_batch) < 0) or mb_batch[0] < 0 or mb_batch[-1] >= num_batches):
        _fail("mb_batch", f"plan dump: mb_batch must be non-decreasing within [0, {num_batches})")
    if ((sample_gpu < 0) | (sample_gpu >= g)).any():
        _fail("sample_gpu range", f"plan dump: sample_gpu has ids outside [0, {g})")
    if ((sample_mb < 0) | (sample_mb >= m)).any():
        _fail("sample_mb range", f"plan dump: sample_mb has ids outside [0, {m})")
    if counts is not None:
        c = np.asarray(counts)
        if c.shape != (sample_gpu.shape[0], num_layers, num_experts):
            _fail(
                "shape",
                f"plan dump: counts has shape {c.shape}; expected "
                f"[{sample_gpu.shape[0]}, {num_layers}, {num_experts}]",
            )
        expected = sample_loads(c, sample_gpu, sample_mb, m, g)
        if not np.array_equal(expected, load):
            idx = _first(expected != load)
            _fail("load", f"plan dump: load{idx}={load[idx]} but the counts give {expected[idx]}")
    in_node = (
        bool(meta.get("replicas_in_home_node", True))
        if replicas_in_home_node is None
        else (replicas_in_home_node)
    )
    for b in range(num_batches):
        mbs = np.flatnonzero(mb_batch == b)
        check_assignment(
            home[b],
            assign[mbs],
            load[mbs],
            gpus_per_node=int(meta.get("nvl_domain", gpn)),
            replica_slots=int(meta["replica_slots"]),
            redundant_slots=int(meta["redundant_slots"]),
            replicas_in_home_node=in_node,
            where=f"plan dump batch {b}",
        )
    return meta
