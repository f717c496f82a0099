"""The run spec: one frozen dataclass tree of a composed run config, built and checked once at the entry.

:func:`build_spec` turns Hydra's composed ``DictConfig`` into a :class:`RunSpec`; every stage below the entry
(builders, checks, the grid runner, the store) reads the spec's typed fields, never the ``DictConfig``.

How a composition becomes a spec:

1. the composition is resolved to plain data (:attr:`RunSpec.composed`: what the results store keys and
   records, so a cell's key is what it was before the spec existed);
2. every leaf of a typed field is held to its annotation: an ``int`` field takes an integer (not a bool,
   not a string), a ``float`` field a finite number, a ``str`` field a string, a ``bool`` field a YAML
   boolean only (OmegaConf would read ``no``, ``'false'`` or ``1`` as booleans and ``'8'`` as an
   integer), ``None`` only where the annotation allows it;
3. the tree is merged onto ``OmegaConf.structured`` of the spec's schema (:func:`_schema`, generated from
   the dataclasses below; each node once per distinct content, as a grid's cells share most nodes), so
   OmegaConf refuses a key no field declares, a value of the wrong shape and a missing required one;
4. the planner and the executor nodes (:class:`TargetNode`) are open: each key must be a parameter of the
   ``_target_`` it instantiates (the settings dataclass or builder that the planner's registry card names,
   :data:`relibra.planners.registry.CARDS`), typed by its annotation, recursively for the stage nodes that
   carry a ``_target_``;
5. the dataclasses are built from the composition's own values (so every number is the one the yaml
   gives, bit for bit); the library's own (:class:`~relibra.cluster.ModelSpec`,
   :class:`~relibra.cluster.HardwareSpec`, :class:`~relibra.parallel.ParallelDims`,
   :class:`~relibra.cost.step.TrainingSpec`) run their checks as they are built, and one they refuse is
   kept unchecked so that :func:`experiments.config.checks.check_config` names its refusal beside every
   other problem of the config.

Each refusal is one :class:`~experiments.config.errors.ConfigError` line naming the key (the closest known key
for an unknown one). The checks of values, ranges and the rules that relate keys to each other or to files
run afterwards, once, on the spec (:func:`experiments.config.checks.check_config`, which returns the spec
every stage then reads).

A default lives in one place: a field default below (or the library dataclass a node is), used where the
composition does not hold the key, and named by the yaml where it does (``${default:KEY}``,
:mod:`experiments.config.resolvers`). A key without a default (a model's ``hidden``, the hardware's rates) is
a required field: its value is the yaml's (docs/experiments.md, "The run spec").
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, make_dataclass, replace
from functools import cache, lru_cache
from typing import Any, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from experiments.config.errors import ConfigError
from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.step import TrainingSpec
from relibra.parallel import ParallelDims
from relibra.simulator import SimOptions

__all__ = [
    "ClusterNode",
    "ControlPlaneNode",
    "LoggerNode",
    "MigrationNode",
    "PeerNode",
    "ReplayNode",
    "RunSpec",
    "SimulatorNode",
    "TargetNode",
    "TraceNode",
    "WorkloadNode",
    "build_spec",
]


@dataclass(frozen=True)
class TargetNode:
    """A node that ``hydra.utils.instantiate`` builds (``planner``, ``executor``): its ``_target_``, its
    ``name`` and the other keys, checked against the target's parameters (module docstring, step 4)."""

    target: str
    """Import path of the class or builder (the yaml's ``_target_``)."""
    name: str
    settings: Mapping[str, Any]
    """The node's other keys as plain data (stage nodes keep their own ``_target_``)."""

    def node(self) -> dict[str, Any]:
        """The node as ``hydra.utils.instantiate`` takes it (a plain mapping with ``_target_``)."""
        return {"_target_": self.target, "name": self.name, **self.settings}

    def setting(self, key: str, default: Any = None) -> Any:
        """The setting ``key`` where this target takes it (``default`` where it does not)."""
        return self.settings.get(key, default)


@dataclass(frozen=True)
class ClusterNode:
    """``cluster.*``: the EP group (:class:`relibra.cluster.ClusterSpec`'s fields, the calibration file)."""

    nodes: int
    gpus_per_node: int
    hardware: HardwareSpec
    dispatcher: str = ClusterSpec.dispatcher
    ep_overlap: bool = ClusterSpec.ep_overlap
    nvl_domain: int | None = ClusterSpec.nvl_domain
    precision: str = ClusterSpec.precision
    comm_sms: int | None = ClusterSpec.comm_sms
    calibration: str | None = None
    """Measured expert-GEMM curve (``relibra.cost.calibration``); None: the roofline."""


@dataclass(frozen=True)
class TraceNode:
    """``trace.*``: a routing trace file, or the synthetic generator's settings."""

    preset: str
    num_batches: int
    samples_per_batch: int
    max_tokens: int
    path: str | None = None
    dataset: str | None = None
    """The ``dataset`` result column; None: the preset, or the trace file's meta or stem."""


@dataclass(frozen=True)
class WorkloadNode:
    """``workload.*``: how samples become micro-batches, and the RL step's passes."""

    layout: str
    samples_per_microbatch: int | None
    tokens_per_microbatch: int | None
    rl_passes: tuple[str, ...] = TrainingSpec.rl_passes


@dataclass(frozen=True)
class MigrationNode:
    """``simulator.migration.*``: None keeps :class:`relibra.cost.migration.MigrationPayload`'s default."""

    weight_bytes: float | None = None
    master_weight_bytes: float | None = None
    optimizer_state_bytes: float | None = None
    path: str | None = None
    window_s: float | None = None


@dataclass(frozen=True)
class SimulatorNode:
    """``simulator.*``: what a step is and how the simulator runs."""

    memory_check: str
    step: str = TrainingSpec.step
    history_window: int = SimOptions.history_window
    check_plans: bool = SimOptions.check_plans
    migration: MigrationNode = field(default_factory=MigrationNode)


@dataclass(frozen=True)
class ControlPlaneNode:
    """``control_plane.*``: planning behind :class:`relibra.control.plane.ControlPlane`."""

    enabled: bool
    workers: int
    deadline_s: float | None = None
    locality_deadline_s: float | None = None


@dataclass(frozen=True)
class ReplayNode:
    """``replay.*``: routing replay (:mod:`relibra.trace.mismatch`)."""

    mismatch: float


@dataclass(frozen=True)
class LoggerNode:
    """``logger.*``: ``none``, or W&B's settings (:mod:`experiments.tracking.wandb_logger`; the defaults are
    these, which ``conf/logger/wandb.yaml`` names)."""

    name: str
    project: str = "relibra"
    entity: str | None = None
    """None: W&B's default entity of the API key."""
    group: str | None = None
    tags: tuple[str, ...] = ()
    mode: str = "offline"
    """``WANDB_MODE`` where the environment does not set it (``online``, ``offline``, ``disabled``)."""
    init_timeout_s: float = 15.0
    """Seconds ``wandb.init`` waits for the server when online (W&B's own default is 90)."""


@dataclass(frozen=True)
class PeerNode:
    """``peer.*`` (``+experiment=peer``): the peer's token-imbalance workload (:mod:`relibra.trace.peer`)."""

    workload: str
    steps: int
    tokens: int
    layer_seeds: bool
    ep: str
    dir: str


@dataclass(frozen=True)
class RunSpec:
    """One run's configuration, typed (module docstring). Nodes are named as the config keys."""

    seed: int
    dump_plans: bool
    model: ModelSpec
    cluster: ClusterNode
    trace: TraceNode
    workload: WorkloadNode
    training: TrainingSpec
    """``training.*``; its ``step`` and ``rl_passes`` are ``simulator.step`` and ``workload.rl_passes``
    (:func:`experiments.config.build.build_training`)."""
    planner: TargetNode
    executor: TargetNode
    logger: LoggerNode
    control_plane: ControlPlaneNode
    replay: ReplayNode
    simulator: SimulatorNode
    parallel: ParallelDims = field(default_factory=ParallelDims)
    """``parallel.*``: the parallel dimensions around the EP group (:class:`relibra.parallel.ParallelDims`
    holds the defaults)."""
    results_dir: str | None = None
    run_dir: str | None = None
    experiment_name: str | None = None
    peer: PeerNode | None = None
    ep_nodes: Mapping[str, int] = field(default_factory=dict)
    """A preset's lookup tables (``conf/experiment/common/paper_scale.yaml``, ``peer.yaml``): read by the
    composition's interpolations only."""
    pp_stages: Mapping[str, int] = field(default_factory=dict)
    dp_replicas: Mapping[str, int] = field(default_factory=dict)
    peer_nodes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    peer_chunk_layers: Mapping[str, Any] = field(default_factory=dict)
    composed: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The resolved composition as plain data: what the results store keys and records
    (:func:`experiments.store.cell_key`). Not a field of the schema."""


_OPEN = (TargetNode,)
"""Spec types whose keys are checked against a target's parameters, not by the schema."""
_NOT_KEYS = frozenset({"composed"})
"""Fields of :class:`RunSpec` that no composition holds."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), len(args) < len(typing.get_args(tp))
    return tp, False


def _schema_type(tp: Any) -> Any:
    """``tp`` as OmegaConf reads it: a spec dataclass -> its schema, a target node or a mapping -> an open
    ``dict[str, Any]``, a tuple -> a list."""
    inner, optional = _optional(tp)
    origin = typing.get_origin(inner)
    if inner in _OPEN or origin in (Mapping, dict) or inner is Mapping:
        out: Any = dict[str, Any]
    elif origin is tuple:
        out = list[typing.get_args(inner)[0]]  # type: ignore[misc]
    elif (nested := _nested(inner)) is not None:
        out = _schema(nested)
    else:
        out = inner
    return out | None if optional else out


def _nested(tp: Any) -> type | None:
    """The spec dataclass a field of type ``tp`` holds (None: a leaf, a mapping or a target node)."""
    inner, _ = _optional(tp)
    return (
        typing.cast(type, inner)
        if isinstance(inner, type) and is_dataclass(inner) and inner not in _OPEN
        else None
    )


@cache
def _schema(cls: type, flat: bool = False) -> type:
    """The OmegaConf schema of spec dataclass ``cls``: the same fields and defaults, nested spec types
    replaced as :func:`_schema_type` says, not frozen (OmegaConf merges into it). ``flat``: without the
    fields that hold a nested spec dataclass (those are checked node by node, :func:`_checked_node`)."""
    hints = _hints(cls)
    specs: list[Any] = []
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in _NOT_KEYS or (flat and _nested(hints[f.name]) is not None):
            continue
        tp = _schema_type(hints[f.name])
        if f.default is not MISSING:
            specs.append((f.name, tp, field(default=f.default)))
        elif f.default_factory is not MISSING:
            made = _nested(type(f.default_factory()))
            if made is not None:
                specs.append((f.name, tp, field(default_factory=_schema(made))))
            else:
                specs.append((f.name, tp, field(default_factory=f.default_factory)))
        else:
            specs.append((f.name, tp))
    return make_dataclass(f"{cls.__name__}{'Flat' if flat else ''}Schema", specs)


def _merged(schema: type, node: Any, prefix: str, known: list[str]) -> None:
    """Merge ``node`` onto ``OmegaConf.structured(schema)``: OmegaConf's refusal (an unknown key, a value
    of the wrong shape, a missing one) as one :class:`ConfigError` line."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node)
        OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as exc:
        raise ConfigError("bad configuration: " + _one_line(exc, prefix, known)) from exc


@lru_cache(maxsize=256)
def _check_node(cls: type, text: str, prefix: str, flat: bool = False) -> None:
    """:func:`_merged` of one node (its JSON ``text``) onto ``cls``'s schema, cached: a grid's cells share
    most nodes."""
    _merged(_schema(cls, flat), json.loads(text), prefix, _known(RunSpec))


def _open(tp: Any) -> bool:
    """Whether a field of type ``tp`` is an open node: a :class:`TargetNode` or a mapping."""
    inner, _ = _optional(tp)
    return inner in _OPEN or inner is Mapping or typing.get_origin(inner) in (Mapping, dict)


_KIND = {bool: "a boolean, true or false (YAML booleans only)", int: "an integer", float: "a number"}


def _leaf_problem(key: str, value: Any, tp: Any) -> str | None:
    """Why ``value`` does not fit the leaf annotation ``tp`` (None: it fits); module docstring, step 2."""
    inner, optional = _optional(tp)
    if value is None:
        if optional or inner not in _KIND:
            return None
        return f"{key}=null: must be {_KIND[inner]}"
    if inner is bool and not isinstance(value, bool):
        return f"{key}={value!r}: must be {_KIND[bool]}"
    if inner is int and (isinstance(value, bool) or not isinstance(value, int)):
        return f"{key}={value!r}: must be {_KIND[int]}"
    if inner is float and (
        isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
    ):
        return f"{key}={value!r}: must be a finite number"
    if inner is str and not isinstance(value, str):
        return f"{key}={value!r}: must be a string"
    return None


def _strict(cls: type, tree: Mapping[str, Any], prefix: str, problems: list[str]) -> None:
    """Hold each leaf of ``tree`` to the field annotation of ``cls`` (module docstring, step 2)."""
    hints = _hints(cls)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in tree or f.name in _NOT_KEYS:
            continue
        key, value, tp = f"{prefix}{f.name}", tree[f.name], hints[f.name]
        inner, _ = _optional(tp)
        if (nested := _nested(tp)) is not None:
            if isinstance(value, Mapping):
                _strict(nested, value, key + ".", problems)
        elif typing.get_origin(inner) is tuple:
            (item,) = {a for a in typing.get_args(inner) if a is not Ellipsis}
            if isinstance(value, list):
                problems += [p for i, v in enumerate(value) if (p := _leaf_problem(f"{key}[{i}]", v, item))]
            elif value is not None or not _optional(tp)[1]:
                what = {int: "integers", float: "numbers", str: "strings"}.get(item, "values")
                problems.append(f"{key}={value!r}: must be a list of {what}")
        elif (why := _leaf_problem(key, value, tp)) is not None:
            problems.append(why)


def _known(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key the schema of ``cls`` declares (for the closest-key hint)."""
    keys: list[str] = []
    hints = _hints(cls)
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name in _NOT_KEYS:
            continue
        keys.append(prefix + f.name)
        if (nested := _nested(hints[f.name])) is not None:
            keys += _known(nested, f"{prefix}{f.name}.")
    return keys


def _closest(key: str, known: list[str]) -> str:
    parent = key.rpartition(".")[0]
    siblings = [k for k in known if k.rpartition(".")[0] == parent]
    for pool in (siblings, known):
        match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
        if match:
            return f"; the closest known key is {match[0]}"
    return ""


def _unknown(key: str, known: list[str]) -> str:
    return (
        f"{key}: unknown key (no config group, preset or planner settings node holds it, so no code reads it)"
        + _closest(key, known)
    )


def _target(path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _annotations(target: Any) -> dict[str, Any]:
    """The parameter annotations of ``target`` (a dataclass's fields, a function's parameters); {} when
    they cannot be resolved."""
    try:
        return typing.get_type_hints(target)
    except (NameError, TypeError):
        return {}


def _target_problems(node: Mapping[str, Any], key: str, allowed: frozenset[str]) -> list[str]:
    """Each key of the instantiated node ``node`` (at ``key``) that its ``_target_`` does not take or whose
    value does not fit the parameter's annotation, and the same for the nodes inside it that carry a
    ``_target_`` (module docstring, step 4). An unknown target is left to the checks, which name it."""
    target = _target(str(node.get("_target_")))
    if target is None:
        return []
    params = inspect.signature(target).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return []
    hints = _annotations(target)
    known = sorted({*params, *allowed, "_target_"})
    problems: list[str] = []
    for name, value in node.items():
        where = f"{key}.{name}"
        if name not in known:
            problems.append(_unknown(where, [f"{key}.{k}" for k in known]))
        elif isinstance(value, Mapping):
            nested = (
                [(name, value)]
                if "_target_" in value
                else [
                    (f"{name}.{k}", v) for k, v in value.items() if isinstance(v, Mapping) and "_target_" in v
                ]
            )
            for inner, child in nested:
                problems += _target_problems(child, f"{key}.{inner}", frozenset())
        elif name in hints and (why := _leaf_problem(where, value, hints[name])) is not None:
            problems.append(why)
    return problems


def _one_line(exc: OmegaConfBaseException, prefix: str, known: list[str]) -> str:
    key = prefix + str(getattr(exc, "full_key", "") or "")
    if isinstance(exc, ConfigKeyError) and key:
        return _unknown(key, known)
    reason = " ".join(str(exc).splitlines()[0].split())
    return f"{key}: {reason}" if key else reason


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def _make(cls: type, tree: Mapping[str, Any]) -> Any:
    """The spec dataclass ``cls`` from the schema-checked plain ``tree`` (lists as tuples)."""
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in tree:
            continue
        value = tree[f.name]
        inner, _ = _optional(hints[f.name])
        if value is None:
            kwargs[f.name] = None
        elif inner is TargetNode:
            rest = {k: v for k, v in value.items() if k not in ("_target_", "name")}
            kwargs[f.name] = TargetNode(str(value["_target_"]), str(value["name"]), rest)
        elif (nested := _nested(inner)) is not None:
            kwargs[f.name] = _make(nested, value)
        elif typing.get_origin(inner) is tuple:
            kwargs[f.name] = _tuples(value)
        else:
            kwargs[f.name] = value
    if cls.__module__ == __name__:
        return cls(**kwargs)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError):
        return _unchecked(cls, kwargs)


def _unchecked(cls: type, kwargs: dict[str, Any]) -> Any:
    """A library dataclass (``ModelSpec``, ``ParallelDims``, ...) whose own check refused ``kwargs``,
    built without that check, so that :func:`experiments.config.checks.check_config` can gather its refusal
    with every other problem of the config (it builds the node again and names why). Never handed to a
    stage: only a checked spec is."""
    node: Any = object.__new__(cls)
    for f in fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        else:
            continue  # NOTE: a required field the composition lacks: OmegaConf named it already
        object.__setattr__(node, f.name, value)
    return node


def build_spec(cfg: DictConfig | Mapping[str, Any]) -> RunSpec:
    """The :class:`RunSpec` of a composed config (module docstring). Raises :class:`ConfigError`."""
    given = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    plain: dict[str, Any] = {str(k): v for k, v in typing.cast(Mapping[str, Any], given).items()}
    tree = {k: v for k, v in plain.items() if k != "hydra"}
    known = _known(RunSpec)
    hints = _hints(RunSpec)
    problems = [_unknown(k, known) for k in tree if k not in hints or k in _NOT_KEYS]
    for f in fields(RunSpec):
        node = tree.get(f.name)
        if f.name not in tree and f.default is MISSING and f.default_factory is MISSING:
            problems.append(f"{f.name}: missing (a config group option or node of the run config)")
        elif hints[f.name] is TargetNode and not (
            isinstance(node, Mapping) and "_target_" in node and "name" in node
        ):
            problems.append(f"{f.name}: unknown or incomplete {f.name} config (needs _target_ and name)")
        elif hints[f.name] is TargetNode:
            problems += _target_problems(typing.cast(Mapping[str, Any], node), f.name, frozenset({"name"}))
    _strict(RunSpec, tree, "", problems)
    if problems:
        raise ConfigError("bad configuration: " + "; ".join(dict.fromkeys(problems)))
    # NOTE: an open node (planner, executor, a preset's lookup table) is a mapping to OmegaConf and no more
    # (its keys were checked above), so it is merged empty: the merge is most of a spec's time.
    flat = {
        k: {} if isinstance(v, Mapping) and _open(hints[k]) else v
        for k, v in tree.items()
        if _nested(hints[k]) is None
    }
    _check_node(RunSpec, json.dumps(flat, sort_keys=True), "", flat=True)
    for name, value in tree.items():
        if (cls := _nested(hints[name])) is not None and value is not None:
            _check_node(cls, json.dumps(value, sort_keys=True), f"{name}.")
    try:
        spec: RunSpec = _make(RunSpec, tree)
    except (ValueError, TypeError) as exc:
        raise ConfigError("bad configuration: " + " ".join(str(exc).split())) from exc
    return replace(spec, composed=plain)
