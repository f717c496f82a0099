"""The checks of a run's configuration before any work: :func:`check_config` and one problem collector per
key family (run-wide keys, the spec dataclasses' numbers, the planner and its stage settings, the cluster's
NVLink domain and dispatcher, migration and the parallel dimensions, the whole step, the trace file).

:func:`check_config` builds the run spec first (:func:`experiments.config.spec.build_spec`: OmegaConf
refuses unknown keys and values of the wrong type), then runs every collector on the typed spec: ranges,
choices and the rules that relate keys to each other or to files. Each collector returns the problems it
finds as one-line strings naming the key; :func:`check_config` gathers them all and raises one
:class:`~experiments.config.errors.ConfigError`, so a user sees every bad key at once. The spec it returns is
the one every later stage reads, so a config is checked once.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from baselines.force_balanced import ROUTINGS
from experiments.config.build import build_cluster, build_cost, build_training, read_trace
from experiments.config.errors import ConfigError
from experiments.config.executor_check import _executor_problems
from experiments.config.input_memory import input_memory_problems
from experiments.config.parallel_check import memory_problems, parallel_problems
from experiments.config.spec import RunSpec, build_spec
from relibra.cluster import (
    PRECISIONS,
    comm_sms_problem,
    grouped_gemm_problems,
    nvl_domain_problem,
)
from relibra.cost.calibration import load_calibration
from relibra.cost.fabric import DISPATCHERS
from relibra.cost.migration import migration_payload
from relibra.layout import LAYOUTS
from relibra.planners.protocols import ClusterRequirements
from relibra.trace.format import FORMAT_DOC, TraceFormatError

__all__ = ["SEED_MAX", "check_config", "path_given", "writable_dir"]


SEED_MAX = int(np.iinfo(np.int64).max)
"""Largest ``seed``: the results' ``seed`` column is int64 (parquet), and numpy's generators refuse
negative seeds, so seeds lie in ``[0, 2**63 - 1]``."""


EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""What ``experiment_name`` may be: a file name of its own (no ``/``, no ``..``), as it names a folder."""


def _at_least(key: str, value: float | None, least: float, problems: list[str], strict: bool = False) -> bool:
    """Whether ``value`` (unset: None) is >= ``least`` (> with ``strict``); else a problem naming ``key``."""
    if value is None or value > least or (value == least and not strict):
        return True
    problems.append(f"{key}={value}: must be {'>' if strict else '>='} {least:g}")
    return False


def _run_problems(spec: RunSpec) -> list[str]:
    """The run-wide keys: ``seed``, ``control_plane.*``, ``simulator.history_window``, ``replay.mismatch``,
    the logger's wait."""
    problems: list[str] = []
    if _at_least("seed", spec.seed, 0, problems) and spec.seed > SEED_MAX:
        problems.append(f"seed={spec.seed}: must be <= {SEED_MAX}")
    cp = spec.control_plane
    _at_least("control_plane.workers", cp.workers, 0, problems)
    _at_least("control_plane.deadline_s", cp.deadline_s, 0, problems)
    _at_least("control_plane.locality_deadline_s", cp.locality_deadline_s, 0, problems)
    _at_least("simulator.history_window", spec.simulator.history_window, 0, problems)
    mismatch = spec.replay.mismatch
    if not 0 <= mismatch <= 1:
        problems.append(
            f"replay.mismatch={mismatch!r}: must be a number in [0, 1], the fraction of routed slots the "
            "training step re-draws (0: exact routing replay)"
        )
    if spec.logger.name == "wandb":
        _at_least("logger.init_timeout_s", spec.logger.init_timeout_s, 0, problems, strict=True)
        from experiments.tracking.wandb_logger import (
            logger_problems,
        )  # NOTE: imports wandb, so only when it logs

        problems += logger_problems(spec.logger)
    name = spec.experiment_name
    if name is not None and not EXPERIMENT_NAME.fullmatch(name):
        problems.append(
            f"experiment_name={name!r}: must be a plain name (letters, digits, '_', '-'; the analysis picks "
            "each experiment's tables by it, and results_dir and the W&B group are made from it)"
        )
    return problems


def _spec_problems(spec: RunSpec) -> list[str]:
    """Every number of the model and hardware specs (:class:`~relibra.cluster.ModelSpec`,
    :class:`~relibra.cluster.HardwareSpec`) is >= 0."""
    problems: list[str] = []
    for prefix, node in (("model", spec.model), ("cluster.hardware", spec.cluster.hardware)):
        for f in fields(node):
            value = getattr(node, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                _at_least(f"{prefix}.{f.name}", value, 0, problems)
    return problems


def _window_problems(spec: RunSpec) -> list[str]:
    """``model.attention_window`` (null or keys >= 1) and ``model.windowed_layers`` (0 to the layers; a
    window when > 0), as :class:`relibra.cluster.ModelSpec` requires them."""
    problems: list[str] = []
    window, windowed, layers = spec.model.attention_window, spec.model.windowed_layers, spec.model.num_layers
    _at_least("model.attention_window", window, 1, problems)
    if not 0 <= windowed <= layers:
        problems.append(f"model.windowed_layers={windowed}: expected 0 to model.num_layers={layers}")
    elif windowed and window is None:
        problems.append(f"model.windowed_layers={windowed} needs model.attention_window (keys per query)")
    return problems


def _library_problems(spec: RunSpec, named: list[str]) -> list[str]:
    """The library dataclasses' own checks (:class:`~relibra.cluster.ModelSpec`,
    :class:`~relibra.cluster.HardwareSpec`, :class:`~relibra.parallel.ParallelDims`): a node they refuse
    is built unchecked by :func:`~experiments.config.spec.build_spec` so that every check here runs; each
    refusal is added unless a problem in ``named`` already names a key of that node."""
    problems: list[str] = []
    for prefix, node in (("model.", spec.model), ("cluster.hardware.", spec.cluster.hardware),
                         ("parallel.", spec.parallel)):  # fmt: skip
        try:
            replace(node)
        except (ValueError, TypeError) as exc:
            if not any(prefix in p for p in named):
                problems.append(" ".join(str(exc).split()))
    return problems


def _mla_problems(spec: RunSpec) -> list[str]:
    """``mla_up_proj`` recompute only for a model with multi-head latent attention
    (``model.kv_lora_rank > 0``), as :mod:`relibra.cost.recompute` requires."""
    if spec.model.kv_lora_rank <= 0 and "mla_up_proj" in spec.training.recompute_modules:
        return [
            f"training.recompute_modules={list(spec.training.recompute_modules)}: mla_up_proj recomputes "
            f"multi-head latent attention's up projections, but model {spec.model.name} has grouped-query "
            "attention (model.kv_lora_rank=0)"
        ]
    return []


def writable_dir(key: str, value: str) -> str | None:
    """Why results could not be written under directory ``value`` (None: they could); leaves nothing behind
    (a nameless temporary file tells whether the nearest existing folder takes files)."""
    path = Path(value).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{key}={value}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{key}={value}: {existing} is not writable"
    try:  # NOTE: mode bits do not bind root, nor say what /proc or a read-only mount allow: try a file
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{key}={value}: {existing} is not writable ({err.strerror or err})"
    return None


def path_given(spec: RunSpec) -> bool:
    """Whether the run reads a trace file (``trace.path``) rather than the synthetic generator."""
    return bool(spec.trace.path)


def _planner_keys(node: Any, name: str, prefix: str = "planner") -> Iterator[tuple[str, Any]]:
    """Every key ``name`` under a planner node (portfolio candidates included), with its dotted path."""
    if not isinstance(node, Mapping):
        return
    for key, child in node.items():
        if key == name:
            yield f"{prefix}.{key}", child
        else:
            yield from _planner_keys(child, name, f"{prefix}.{key}")


SETTINGS_NODES = ("reorder", "replicate", "majorize")
"""The planner keys that hold a stage's settings dataclass (``experiments.config.planner_nodes``)."""


def _settings_problems(planner: Mapping[str, Any]) -> list[str]:
    """Each stage's settings (``planner.reorder``, ``planner.replicate``, the candidates' too) built as the
    planner will build them; a refused value is named by its key."""
    problems: list[str] = []
    for name in SETTINGS_NODES:
        for key, node in _planner_keys(planner, name):
            if not isinstance(node, Mapping) or "_target_" not in node:
                continue
            try:
                instantiate(node, _convert_="all")
            except InstantiationException as exc:
                cause = exc.__cause__ if exc.__cause__ is not None else exc
                # NOTE: the settings' own ValueErrors start with the field name (``split='x'; ...``); any
                # other message (a conversion deep inside) is set after the node's key, not joined to it.
                field = re.match(r"(\w+)\s*[=;:]", str(cause))
                named = isinstance(cause, ValueError) and field is not None and field.group(1) in node
                problems.append(f"{key}{'.' if named else ': '}{cause}")
    return problems


def _planner_problems(spec: RunSpec) -> list[str]:
    """The planner's ``_target_``, its stage settings (:func:`_settings_problems`), then the planner itself
    built as the run will build it (cheap: planners plan only when called), so a baseline's refused knob
    stops the run before any work. The planners' own messages name their key (``planner.solver='x'; ...``).
    """
    target = spec.planner.target
    module, _, attr = target.rpartition(".")
    try:
        if not hasattr(importlib.import_module(module), attr):
            raise ImportError(attr)
    except (ImportError, ValueError):
        return [f"planner._target_={target}: unknown planner class"]
    node = spec.planner.node()
    problems = _settings_problems(node)
    if problems:
        return problems
    try:
        instantiate(node, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = " ".join(str(cause).split())
        problems.append(text if text.startswith("planner.") else f"planner ({spec.planner.name}): {text}")
    for key, tolerance in _planner_keys(node, "locality_tolerance"):
        if not (isinstance(tolerance, int | float) and 0 < tolerance <= 1):
            problems.append(
                f"{key}={tolerance}: the locality round's balance tolerance must be in (0, 1] "
                "(the per-GPU token slack it may trade for locality, relative to the mean)"
            )
    routing = spec.planner.setting("routing", ROUTINGS[0])
    if routing not in ROUTINGS:
        problems.append(f"planner.routing={routing}: expected one of {list(ROUTINGS)}")
    return problems


def _cluster_requirements(spec: RunSpec) -> list[str]:
    """What a planner with :class:`~relibra.planners.protocols.ClusterRequirements` cannot honour on this
    cluster (both built as the run builds them; one that cannot be built is reported elsewhere)."""
    try:
        built = instantiate(spec.planner.node(), _convert_="all")
        cluster = build_cluster(spec)
    except (InstantiationException, ValueError, TypeError):
        return []
    if not isinstance(built, ClusterRequirements):
        return []
    return list(built.cluster_problems(spec.model.num_experts, cluster))


def _group_problems(spec: RunSpec) -> list[str]:
    """The EP group: ``cluster.nodes``, ``cluster.gpus_per_node``, the experts over its GPUs, the NVLink
    domain, the planner's cluster requirements and its replica slots."""
    problems: list[str] = []
    c, m = spec.cluster, spec.model
    sizes_ok = all(
        [
            _at_least("cluster.nodes", c.nodes, 1, problems),
            _at_least("cluster.gpus_per_node", c.gpus_per_node, 1, problems),
            _at_least("model.num_experts", m.num_experts, 1, problems),
            _at_least("model.num_moe_layers", m.num_moe_layers, 1, problems),
            _at_least("model.top_k", m.top_k, 1, problems),
        ]
    )
    if m.top_k > m.num_experts >= 1:
        problems.append(
            f"model.top_k={m.top_k}: a token picks distinct experts, at most "
            f"model.num_experts={m.num_experts}"
        )
    if not sizes_ok:
        return problems
    g = c.nodes * c.gpus_per_node
    if m.num_experts % g:
        problems.append(
            f"model.num_experts={m.num_experts} is not divisible by cluster.nodes * cluster.gpus_per_node = "
            f"{c.nodes} * {c.gpus_per_node} = {g}"
        )
        return problems
    if why := nvl_domain_problem(c.nodes, c.gpus_per_node, c.nvl_domain):
        return [*problems, why]
    domain = min(c.nvl_domain if c.nvl_domain is not None else c.gpus_per_node, g)
    problems += _cluster_requirements(spec)
    slots = spec.planner.setting("replica_slots", 0)
    per_domain = m.num_experts // g * domain
    if slots < 0 or slots > per_domain:
        problems.append(
            f"planner.replica_slots={slots} must be in [0, {per_domain}], the experts in an NVLink "
            f"domain (model.num_experts / G * GPUs per domain = {m.num_experts} / {g} * {domain}; the domain "
            "is cluster.nvl_domain, by default cluster.gpus_per_node)"
        )
    return problems


def _comm_problems(spec: RunSpec) -> list[str]:
    """The communication keys: ``cluster.dispatcher``, ``cluster.ep_overlap``, ``cluster.comm_sms`` (with
    ``cluster.hardware.sms``), ``cluster.calibration``, and the grouped-GEMM pricing keys."""
    problems: list[str] = []
    c, hw = spec.cluster, spec.cluster.hardware
    if c.dispatcher not in DISPATCHERS:
        problems.append(f"cluster.dispatcher={c.dispatcher}: unknown; choose one of {', '.join(DISPATCHERS)}")
    if why := comm_sms_problem(c.comm_sms, hw.sms, c.ep_overlap, c.dispatcher):
        problems.append(why)
    spm, per_batch = spec.workload.samples_per_microbatch, spec.trace.samples_per_batch
    if c.ep_overlap and spm is not None and not spec.trace.path:
        g = c.nodes * c.gpus_per_node
        mbs = per_batch // max(spm * g, 1)
        if mbs < 2:
            problems.append(
                f"cluster.ep_overlap=true needs at least 2 micro-batches per batch to overlap, but "
                f"trace.samples_per_batch={per_batch} / (workload.samples_per_microbatch={spm} * G={g}) "
                f"gives {mbs}"
            )
    path = c.calibration
    if path:
        try:
            if load_calibration(path, spec.model.name) is None:
                problems.append(
                    f"cluster.calibration={path} has no entry for model {spec.model.name} (a calibration "
                    "file for another model); measure this model or set cluster.calibration=null"
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"cluster.calibration={path}: {exc}")
    problems += grouped_gemm_problems(
        hw.gemm_model, hw.gemm_tile_m, hw.gemm_tile_n, hw.sms, hw.per_expert_costs
    )
    if path and hw.gemm_model == "tiled":
        problems.append(
            f"cluster.calibration={path} with cluster.hardware.gemm_model=tiled: both replace the expert "
            "GEMM curve; give one"
        )
    return problems


def _migration_problems(spec: RunSpec) -> list[str]:
    """``parallel.*`` and ``simulator.migration.*`` (with the host link of ``cluster.hardware``)."""
    problems = parallel_problems(spec)
    if problems:
        return problems
    try:
        migration_payload(
            asdict(spec.simulator.migration),
            expert_data_parallel=spec.parallel.dp,
            host_to_device_bytes_per_s=spec.cluster.hardware.host_to_device_bytes_per_s,
        )
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    return problems


def _required_positive(key: str, value: float, why: str, problems: list[str]) -> None:
    """``value`` (at ``key``) must be > 0: a value <= 0 is named with ``why``."""
    if not value > 0:
        problems.append(f"{key}={value}: {why} (set it in the cluster yaml, with its source)")


def _step_problems(spec: RunSpec) -> list[str]:
    """The whole step's keys: ``training.*``, ``simulator.step``, ``workload.rl_passes``,
    ``cluster.precision`` and the hardware constants they need."""
    problems: list[str] = []
    given = set(spec.composed.get("training") or ()) & {"step", "rl_passes"}
    if given:
        return [
            f"training.{key}: not a key of training (simulator.step and workload.rl_passes set it)"
            for key in sorted(given)
        ]
    try:
        build_training(spec)
    except (TypeError, ValueError) as exc:
        problems.append(str(exc))
    hw = spec.cluster.hardware
    if spec.simulator.step == "whole":
        why = "simulator.step=whole needs the achievable HBM fraction > 0"
        _required_positive("cluster.hardware.hbm_efficiency", hw.hbm_efficiency, why, problems)
    precision = spec.cluster.precision
    if precision not in PRECISIONS:
        problems.append(f"cluster.precision={precision}: unknown; choose one of {', '.join(PRECISIONS)}")
    elif precision == "fp8":
        for key in ("fp8_flops", "fp8_gemm_efficiency"):
            why = "cluster.precision=fp8 needs it > 0"
            _required_positive(f"cluster.hardware.{key}", getattr(hw, key), why, problems)
    return problems


def _input_problems(spec: RunSpec) -> list[str]:
    """``workload.*`` and ``trace.*``: the sample layout, the micro-batch size, the trace file or the
    generator's settings."""
    problems: list[str] = []
    w, t = spec.workload, spec.trace
    if w.layout not in LAYOUTS:
        problems.append(f"workload.layout={w.layout}: unknown sample layout; expected one of {list(LAYOUTS)}")
    _at_least("workload.samples_per_microbatch", w.samples_per_microbatch, 1, problems)
    _at_least("workload.tokens_per_microbatch", w.tokens_per_microbatch, 1, problems)
    if w.samples_per_microbatch is not None and w.tokens_per_microbatch is not None:
        problems.append(
            f"workload.samples_per_microbatch={w.samples_per_microbatch} and workload.tokens_per_microbatch="
            f"{w.tokens_per_microbatch}: set one, the other null"
        )
    if t.path is not None and not t.path.strip():  # NOTE: an unset shell variable; not the generator
        problems.append(
            f"trace.path={t.path!r}: empty; give a routing trace .npz ({FORMAT_DOC}), or null for the "
            "synthetic generator (trace.preset)"
        )
    elif t.path:
        problems += _trace_problems(spec, t.path)
    else:
        from relibra.trace.synthetic import PRESETS

        for key in ("num_batches", "samples_per_batch", "max_tokens"):
            _at_least(f"trace.{key}", getattr(t, key), 1, problems)
        if t.preset not in PRESETS:
            problems.append(f"trace.preset={t.preset}: unknown; choose one of {sorted(PRESETS)}")
        g = spec.cluster.nodes * spec.cluster.gpus_per_node
        if 1 <= t.samples_per_batch < g:
            problems.append(
                f"trace.samples_per_batch={t.samples_per_batch} cannot fill every GPU in a micro-batch: the "
                f"EP group has cluster.nodes * cluster.gpus_per_node = {g} GPUs; give at least that many"
            )
    return problems


def check_config(cfg: DictConfig | RunSpec) -> RunSpec:
    """Refuse a configuration that cannot work, before any work; return its checked spec. Raises one
    :class:`ConfigError`.

    The one check every entry point runs (``experiments.run``, its multirun sweeper, ``reproduce``): the
    spec (:func:`experiments.config.spec.build_spec`: unknown keys and types, by OmegaConf), then ranges and
    choices of every key, the planner and its settings built as the run builds them, the files (trace
    content included, with the array at fault named), and a ``results_dir`` that can be written. Writes
    nothing.
    """
    spec = cfg if isinstance(cfg, RunSpec) else build_spec(cfg)
    problems = _planner_problems(spec)
    problems += _run_problems(spec)
    problems += _spec_problems(spec)
    problems += _window_problems(spec)
    problems += _mla_problems(spec)
    problems += _library_problems(spec, problems)
    problems += _group_problems(spec)
    problems += _executor_problems(spec, spec.cluster.nodes * spec.cluster.gpus_per_node)
    problems += _migration_problems(spec)
    problems += _comm_problems(spec)
    problems += _step_problems(spec)
    problems += _input_problems(spec)
    if spec.results_dir and (why := writable_dir("results_dir", spec.results_dir)):
        problems.append(why)
    if (
        not problems
    ):  # NOTE: the memory checks build the cost model, so they need a config that passed the rest
        problems += input_memory_problems(spec)
        problems += memory_problems(spec, build_cost(spec, build_cluster(spec), spec.model))
    if problems:
        raise ConfigError("bad configuration: " + "; ".join(dict.fromkeys(problems)))
    return spec


def _trace_problems(spec: RunSpec, path: str) -> list[str]:
    if Path(path).is_dir():
        return [
            f"trace.path={path}: is a directory, not a trace file (give a routing trace .npz, {FORMAT_DOC})"
        ]
    if not Path(path).exists():
        broken = " (a symbolic link to nothing, or a loop of them)" if os.path.islink(path) else ""
        return [f"trace.path={path}: no such file{broken} (give a routing trace .npz, {FORMAT_DOC})"]
    if not Path(path).is_file():  # NOTE: a device (/dev/zero) or a FIFO would be read without end
        return [f"trace.path={path}: not a regular file (give a routing trace .npz, {FORMAT_DOC})"]
    try:
        meta = read_trace(path).meta
    except TraceFormatError as exc:
        return [f"trace.path={path}: {exc}"]
    problems = []
    for key, model_key in (
        ("num_experts", "num_experts"),
        ("num_layers", "num_moe_layers"),
        ("top_k", "top_k"),
    ):
        if meta[key] != getattr(spec.model, model_key):
            problems.append(
                f"trace.path={path} has {key}={meta[key]} but model.{model_key}="
                f"{getattr(spec.model, model_key)} (model={spec.model.name}); pick the model the trace "
                "came from"
            )
    return problems
