"""The checks of a run's configuration before any work: :func:`check_config` and one problem collector per key
family (run-wide keys, the spec dataclasses' numbers, the planner and its stage settings, the cluster's
NVLink domain and dispatcher, migration and the parallel layout, the whole step, the trace file).

Each collector returns the problems it finds as one-line strings naming the key; :func:`check_config` gathers
them all and raises one :class:`~experiments.config.build.ConfigError`, so a user sees every bad key at once.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from baselines.force_balanced import ROUTINGS
from experiments.config.build import (
    ConfigError,
    build_cluster,
    build_cost,
    build_model,
    build_training,
    read_trace,
)
from experiments.config.executor_check import _executor_problems
from experiments.config.input_memory import input_memory_problems
from experiments.config.keys import _int_key, _number_key
from experiments.config.layout_check import layout_problems, memory_problems
from relibra.cluster import (
    MLA_KEYS,
    PRECISIONS,
    HardwareSpec,
    comm_sms_problem,
    grouped_gemm_problems,
    mla_problem,
    nvl_domain_problem,
)
from relibra.cost.calibration import load_calibration
from relibra.cost.fabric import DISPATCHERS
from relibra.cost.migration import migration_payload
from relibra.cost.step import RL_PASSES, TrainingSpec
from relibra.layout import LAYOUTS
from relibra.planners.protocols import ClusterRequirements
from relibra.trace.format import FORMAT_DOC, TraceFormatError

__all__ = ["SEED_MAX", "check_config", "path_given", "writable_dir"]


SEED_MAX = int(np.iinfo(np.int64).max)
"""Largest ``seed``: the results' ``seed`` column is int64 (parquet), and numpy's generators refuse
negative seeds, so seeds lie in ``[0, 2**63 - 1]``."""


EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
"""What ``experiment_name`` may be: a file name of its own (no ``/``, no ``..``), as it names a folder."""


def _run_problems(cfg: DictConfig) -> list[str]:
    """The run-wide keys: ``seed``, ``control_plane.*``, ``simulator.history_window``, ``replay.mismatch``,
    the logger's wait."""
    problems: list[str] = []
    _int_key(cfg, "seed", problems, least=0, required=True, most=SEED_MAX)
    _int_key(cfg, "control_plane.workers", problems, least=0)
    for key in ("control_plane.deadline_s", "control_plane.locality_deadline_s"):
        _number_key(cfg, key, problems)
    _int_key(cfg, "simulator.history_window", problems, least=0)
    mismatch = OmegaConf.select(cfg, "replay.mismatch", default=None)
    if isinstance(mismatch, bool) or not isinstance(mismatch, int | float) or not 0 <= mismatch <= 1:
        problems.append(
            f"replay.mismatch={mismatch!r}: must be a number in [0, 1], the fraction of routed slots the "
            "training step re-draws (0: exact routing replay)"
        )
    if str(OmegaConf.select(cfg, "logger.name", default="none")) == "wandb":
        if OmegaConf.select(cfg, "logger.init_timeout_s", default=None) is None:
            problems.append("logger.init_timeout_s=null: give the seconds W&B may wait for its server")
        _number_key(cfg, "logger.init_timeout_s", problems, strict=True)
        from experiments.tracking.wandb_logger import (
            logger_problems,  # NOTE: imports wandb, so only when it logs
        )

        problems += logger_problems(OmegaConf.to_container(cfg.logger, resolve=True))  # type: ignore[arg-type]
    if (name := cfg.get("experiment_name")) is not None and not (
        isinstance(name, str) and EXPERIMENT_NAME.fullmatch(name)
    ):
        problems.append(
            f"experiment_name={name!r}: must be a plain name (letters, digits, '_', '-'; the analysis picks "
            "each experiment's tables by it, and results_dir and the W&B group are made from it)"
        )
    return problems


SPEC_NODES = ("model", "cluster.hardware")
"""Nodes built into the spec dataclasses (ModelSpec, HardwareSpec), whose numeric keys must be numbers."""


def _spec_problems(cfg: DictConfig) -> list[str]:
    """Every key of the model and hardware specs whose defaults are all numbers (from the config schema,
    :mod:`experiments.config.schema`) holds a number >= 0 (an integer where every default is one), not null.
    The optional MLA keys (:data:`relibra.cluster.MLA_KEYS`) may be absent."""
    from experiments.config.schema import config_schema

    kinds = config_schema().kinds
    problems: list[str] = []
    optional = {f"model.{k}" for k in MLA_KEYS}
    for node in SPEC_NODES:
        depth = node.count(".") + 1
        for key in sorted(k for k in kinds if k.startswith(node + ".") and k.count(".") == depth):
            if OmegaConf.select(cfg, node, default=None) is None or kinds[key] - {"int", "float"}:
                continue
            if key in optional and key.split(".", 1)[1] not in cfg.model:
                continue
            if kinds[key] == {"int"}:
                _int_key(cfg, key, problems, least=0, required=True)
            elif OmegaConf.select(cfg, key, default=None) is None:
                problems.append(f"{key}=null: must be a number")
            else:
                _number_key(cfg, key, problems)
    return problems


def _mla_problems(cfg: DictConfig) -> list[str]:
    """The MLA keys (:data:`relibra.cluster.MLA_KEYS`) only beside ``model.kv_lora_rank > 0``, and
    ``mla_up_proj`` recompute only for such a model, as :class:`relibra.cluster.ModelSpec` and
    :mod:`relibra.cost.recompute` require."""
    values = {k: OmegaConf.select(cfg, f"model.{k}", default=0) for k in MLA_KEYS}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values.values()):
        return []  # NOTE: named by _spec_problems
    problems: list[str] = [p] if (p := mla_problem(values)) else []
    modules = OmegaConf.select(cfg, "training.recompute_modules", default=None)
    if values["kv_lora_rank"] <= 0 and isinstance(modules, Sequence) and "mla_up_proj" in modules:
        problems.append(
            f"training.recompute_modules={list(modules)}: mla_up_proj recomputes multi-head latent "
            f"attention's up projections, but model {cfg.model.get('name')} has grouped-query attention "
            "(model.kv_lora_rank=0)"
        )
    return problems


def _window_problems(cfg: DictConfig) -> list[str]:
    """``model.attention_window`` (null or keys >= 1) and ``model.windowed_layers`` (0 to the layers; a
    window when > 0), as :class:`relibra.cluster.ModelSpec` requires them."""
    problems: list[str] = []
    window = _int_key(cfg, "model.attention_window", problems)
    layers = OmegaConf.select(cfg, "model.num_layers", default=None)
    windowed = OmegaConf.select(cfg, "model.windowed_layers", default=None)
    if problems or not isinstance(windowed, int) or not isinstance(layers, int):
        return problems  # NOTE: a non-integer windowed_layers or num_layers is named by _spec_problems
    if not 0 <= windowed <= layers:
        problems.append(f"model.windowed_layers={windowed}: expected 0 to model.num_layers={layers}")
    elif windowed and window is None:
        problems.append(f"model.windowed_layers={windowed} needs model.attention_window (keys per query)")
    return problems


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


def path_given(cfg: DictConfig) -> bool:
    """Whether the run reads a trace file (``trace.path``) rather than the synthetic generator."""
    return bool(cfg.trace.get("path"))


def _planner_keys(node: Any, name: str, prefix: str = "planner") -> Iterator[tuple[str, Any]]:
    """Every key ``name`` under a planner config (portfolio candidates included), with its dotted path."""
    if not isinstance(node, DictConfig):
        return
    for key in map(str, node):
        child = node.get(key)
        if key == name:
            yield f"{prefix}.{key}", child
        else:
            yield from _planner_keys(child, name, f"{prefix}.{key}")


SETTINGS_NODES = ("reorder", "replicate", "majorize")
"""The planner keys that hold a stage's settings dataclass (``experiments.config.planner_nodes``)."""


def _settings_problems(planner: DictConfig) -> list[str]:
    """Each stage's settings (``planner.reorder``, ``planner.replicate``, the candidates' too) built as the
    planner will build them; a refused value is named by its key."""
    problems: list[str] = []
    for name in SETTINGS_NODES:
        for key, node in _planner_keys(planner, name):
            if not isinstance(node, DictConfig) or "_target_" not in node:
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


def _planner_problems(planner: DictConfig) -> list[str]:
    """The stage settings (:func:`_settings_problems`), then the planner itself built as the run will build
    it (cheap: planners plan only when called), so a baseline's refused knob stops the run before any work.
    The planners' own messages name their key (``planner.solver='x'; ...``)."""
    problems = _settings_problems(planner)
    if problems:
        return problems
    try:
        instantiate(planner, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        text = " ".join(str(cause).split())
        problems.append(text if text.startswith("planner.") else f"planner ({planner.get('name')}): {text}")
    return problems


def _domain_key(cfg: DictConfig, nodes: int, gpn: int, problems: list[str]) -> int | None:
    """GPUs of the EP group per NVLink domain (:attr:`relibra.cluster.ClusterSpec.domain_gpus`), or None
    with a problem naming ``cluster.nvl_domain`` when the group cannot be laid over such domains."""
    value = cfg.cluster.get("nvl_domain")
    problem = nvl_domain_problem(nodes, gpn, value)
    if problem:
        problems.append(problem)
        return None
    return min(int(value) if value is not None else gpn, nodes * gpn)


def _cluster_requirements(cfg: DictConfig, planner: DictConfig, num_experts: int) -> list[str]:
    """What a planner with :class:`~relibra.planners.protocols.ClusterRequirements` cannot honour on this
    cluster (both built as the run builds them; one that cannot be built is reported elsewhere)."""
    if "_target_" not in planner:
        return []
    try:
        built = instantiate(planner, _convert_="all")
        cluster = build_cluster(cfg)
    except (InstantiationException, ValueError, TypeError):
        return []
    if not isinstance(built, ClusterRequirements):
        return []
    return list(built.cluster_problems(num_experts, cluster))


def _comm_problems(cfg: DictConfig) -> list[str]:
    """The communication keys: ``cluster.dispatcher``, ``cluster.ep_overlap``, ``cluster.comm_sms`` (with
    ``cluster.hardware.sms``), ``cluster.calibration``."""
    problems: list[str] = []
    dispatcher = cfg.cluster.get("dispatcher", "alltoall")
    if dispatcher not in DISPATCHERS:
        problems.append(f"cluster.dispatcher={dispatcher}: unknown; choose one of {', '.join(DISPATCHERS)}")
    overlap = cfg.cluster.get("ep_overlap", False)
    sms = OmegaConf.select(cfg, "cluster.hardware.sms", default=0)
    why = comm_sms_problem(cfg.cluster.get("comm_sms"), sms, overlap is True, str(dispatcher))
    if why:
        problems.append(why)
    if bool(cfg.cluster.get("ep_overlap", False)):
        spm = cfg.workload.get("samples_per_microbatch")
        per_batch = cfg.trace.get("samples_per_batch")
        g = int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)
        if spm is not None and per_batch is not None and not cfg.trace.get("path"):
            mbs = int(per_batch) // max(int(spm) * g, 1)
            if mbs < 2:
                problems.append(
                    f"cluster.ep_overlap=true needs at least 2 micro-batches per batch to overlap, but "
                    f"trace.samples_per_batch={per_batch} / (workload.samples_per_microbatch={spm} * G={g}) "
                    f"gives {mbs}"
                )
    path = cfg.cluster.get("calibration")
    if path:
        try:
            if load_calibration(str(path), str(cfg.model.name)) is None:
                problems.append(
                    f"cluster.calibration={path} has no entry for model {cfg.model.name} (a calibration "
                    "file for another model); measure this model or set cluster.calibration=null"
                )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"cluster.calibration={path}: {exc}")
    hw = cfg.cluster.get("hardware") or {}
    default = {f.name: f.default for f in fields(HardwareSpec)}  # NOTE: for a yaml without the keys
    keys = ("gemm_model", "gemm_tile_m", "gemm_tile_n", "sms", "per_expert_costs")
    problems += grouped_gemm_problems(*(hw.get(k, default[k]) for k in keys))
    if path and hw.get("gemm_model") == "tiled":
        problems.append(
            f"cluster.calibration={path} with cluster.hardware.gemm_model=tiled: both replace the expert "
            "GEMM curve; give one"
        )
    return problems


def _migration_problems(cfg: DictConfig) -> list[str]:
    """``parallel.*`` and ``simulator.migration.*`` (with the host link of ``cluster.hardware``)."""
    problems: list[str] = []
    dp = _int_key(cfg, "parallel.dp", problems)
    problems += layout_problems(cfg)
    if problems:
        return problems
    try:
        rate = float(OmegaConf.select(cfg, "cluster.hardware.host_to_device_bytes_per_s", default=0.0) or 0.0)
        migration_payload(
            (cfg.get("simulator") or {}).get("migration"),
            expert_data_parallel=dp or 1,
            host_to_device_bytes_per_s=rate,
        )
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    return problems


def _required_positive(cfg: DictConfig, key: str, why: str, problems: list[str]) -> None:
    """``cfg.<key>`` must be a number > 0: a non-number or a value <= 0 is named by
    :func:`~experiments.config.keys._number_key`, an unset key with ``why``."""
    if _number_key(cfg, key, problems, strict=True) is None and OmegaConf.select(cfg, key) is None:
        problems.append(f"{key}=None: {why} (set it in the cluster yaml, with its source)")


def _step_problems(cfg: DictConfig) -> list[str]:
    """The whole step's keys: ``training.*``, ``simulator.step``, ``workload.rl_passes``,
    ``cluster.precision`` and the hardware constants they need."""
    problems: list[str] = []
    if cfg.get("training") is None:
        return ["training: missing (choose one of experiments/conf/training/*.yaml, e.g. training=megatron)"]
    known = {f.name for f in fields(TrainingSpec)} - {"step", "rl_passes"}
    unknown = sorted(set(map(str, cfg.training)) - known)
    missing = sorted(known - set(map(str, cfg.training)))
    if unknown or missing:
        return [f"training: unknown keys {unknown} / missing keys {missing} (keys: {sorted(known)})"]
    passes = cfg.workload.get("rl_passes", ["update"])
    whole = (cfg.get("simulator") or {}).get("step", "whole") == "whole"
    if not isinstance(passes, Sequence) or isinstance(passes, str):
        problems.append(f"workload.rl_passes={passes!r}: must be a list of passes from {list(RL_PASSES)}")
    else:
        try:
            build_training(cfg)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
    if whole:
        why = "simulator.step=whole needs the achievable HBM fraction > 0"
        _required_positive(cfg, "cluster.hardware.hbm_efficiency", why, problems)
    precision = cfg.cluster.get("precision", "bf16")
    if precision not in PRECISIONS:
        problems.append(f"cluster.precision={precision}: unknown; choose one of {', '.join(PRECISIONS)}")
    elif precision == "fp8":
        for key in ("fp8_flops", "fp8_gemm_efficiency"):
            _required_positive(cfg, f"cluster.hardware.{key}", "cluster.precision=fp8 needs it > 0", problems)
    return problems


def check_config(cfg: DictConfig) -> None:
    """Refuse a configuration that cannot work, before any work. Raises one :class:`ConfigError`.

    The one check every entry point runs (``experiments.run``, its multirun sweeper, ``reproduce``):
    types and ranges of every numeric key, known planner, preset and files (trace content included, with
    the array at fault named), and a ``results_dir`` that can be written. Writes nothing.
    """
    from experiments.config.schema import flag_problems, unknown_keys

    problems: list[str] = [*unknown_keys(cfg), *flag_problems(cfg)]
    if problems:  # NOTE: a stray or non-boolean key first: the checks below read the keys as typed
        raise ConfigError("bad configuration: " + "; ".join(problems))
    planner = cfg.get("planner")
    if planner is None or "_target_" not in planner or "name" not in planner:
        problems.append(
            "planner: unknown or incomplete planner config (needs _target_ and name; "
            "choose one of experiments/conf/planner/*.yaml)"
        )
    else:
        module, _, attr = str(planner._target_).rpartition(".")
        try:
            if not hasattr(importlib.import_module(module), attr):
                raise ImportError(attr)
        except ImportError:
            problems.append(f"planner._target_={planner._target_}: unknown planner class")
        else:
            problems.extend(_planner_problems(planner))
    problems += _run_problems(cfg)
    problems += _spec_problems(cfg)
    nodes = _int_key(cfg, "cluster.nodes", problems, required=True)
    gpn = _int_key(cfg, "cluster.gpus_per_node", problems, required=True)
    e = _int_key(cfg, "model.num_experts", problems, required=True)
    layers_k = [
        _int_key(cfg, key, problems, required=True) for key in ("model.num_moe_layers", "model.top_k")
    ]
    if e is not None and layers_k[1] is not None and layers_k[1] > e:
        problems.append(
            f"model.top_k={layers_k[1]}: a token picks distinct experts, at most model.num_experts={e}"
        )
    problems += _window_problems(cfg)
    problems += _mla_problems(cfg)
    problems += _executor_problems(cfg, nodes * gpn if nodes is not None and gpn is not None else None)
    if nodes is not None and gpn is not None and e is not None:
        g = nodes * gpn
        if e % g:
            problems.append(
                f"model.num_experts={e} is not divisible by cluster.nodes * cluster.gpus_per_node = "
                f"{nodes} * {gpn} = {g}"
            )
        elif (domain := _domain_key(cfg, nodes, gpn, problems)) is not None and planner is not None:
            problems.extend(_cluster_requirements(cfg, planner, e))
            present = "replica_slots" in planner
            slots = _int_key(cfg, "planner.replica_slots", problems, least=None, required=present) or 0
            per_domain = e // g * domain
            if slots < 0 or slots > per_domain:
                problems.append(
                    f"planner.replica_slots={slots} must be in [0, {per_domain}], the experts in an NVLink "
                    f"domain (model.num_experts / G * GPUs per domain = {e} / {g} * {domain}; the domain is "
                    "cluster.nvl_domain, by default cluster.gpus_per_node)"
                )
    layout = cfg.workload.get("layout")
    if layout not in LAYOUTS:
        problems.append(f"workload.layout={layout}: unknown sample layout; expected one of {list(LAYOUTS)}")
    if planner is not None:
        for key, tolerance in _planner_keys(planner, "locality_tolerance"):
            if not (isinstance(tolerance, int | float) and 0 < tolerance <= 1):
                problems.append(
                    f"{key}={tolerance}: the locality round's balance tolerance must be in (0, 1] "
                    "(the per-GPU token slack it may trade for locality, relative to the mean)"
                )
        routing = planner.get("routing", ROUTINGS[0])
        if routing not in ROUTINGS:
            problems.append(f"planner.routing={routing}: expected one of {list(ROUTINGS)}")
    problems.extend(_migration_problems(cfg))
    per_batch = OmegaConf.select(cfg, "trace.samples_per_batch", default=None)
    if not path_given(cfg) and nodes is not None and gpn is not None and isinstance(per_batch, int):
        if per_batch < nodes * gpn:
            problems.append(
                f"trace.samples_per_batch={per_batch} cannot fill every GPU in a micro-batch: the EP group "
                f"has cluster.nodes * cluster.gpus_per_node = {nodes * gpn} GPUs; give at least that many"
            )
    problems.extend(_comm_problems(cfg))
    problems.extend(_step_problems(cfg))
    spm = _int_key(cfg, "workload.samples_per_microbatch", problems)
    tpm = _int_key(cfg, "workload.tokens_per_microbatch", problems)
    if spm is not None and tpm is not None:
        problems.append(
            f"workload.samples_per_microbatch={spm} and workload.tokens_per_microbatch={tpm}: set one, "
            "the other null"
        )
    path = cfg.trace.get("path")
    if path is not None and not str(path).strip():  # NOTE: an unset shell variable; not the generator
        problems.append(
            f"trace.path={path!r}: empty; give a routing trace .npz ({FORMAT_DOC}), or null for the "
            "synthetic generator (trace.preset)"
        )
    elif path:
        problems += _trace_problems(cfg, str(path))
    else:
        from relibra.trace.synthetic import PRESETS

        for key in ("trace.num_batches", "trace.samples_per_batch", "trace.max_tokens"):
            _int_key(cfg, key, problems, required=True)
        preset = cfg.trace.get("preset")
        if preset not in PRESETS:
            problems.append(f"trace.preset={preset}: unknown; choose one of {sorted(PRESETS)}")
    results_dir = cfg.get("results_dir")
    if results_dir and (why := writable_dir("results_dir", str(results_dir))):
        problems.append(why)
    if (
        not problems
    ):  # NOTE: the memory check builds the cost model, so it needs a config that passed the rest
        problems += input_memory_problems(cfg)
        cluster, model = build_cluster(cfg), build_model(cfg)
        problems += memory_problems(cfg, build_cost(cfg, cluster, model))
    if problems:
        raise ConfigError("bad configuration: " + "; ".join(dict.fromkeys(problems)))


def _trace_problems(cfg: DictConfig, path: str) -> list[str]:
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
        if meta[key] != cfg.model.get(model_key):
            problems.append(
                f"trace.path={path} has {key}={meta[key]} but model.{model_key}="
                f"{cfg.model.get(model_key)} (model={cfg.model.get('name')}); pick the model the trace "
                "came from"
            )
    return problems
