"""The command line's schema: every key a composed config can hold, derived from the config groups, so that
:func:`override_problems` refuses a bad override before Hydra composes anything.

Nothing here is a hand-written list. :func:`config_schema` walks Hydra's config repository from the primary
config (``conf/config.yaml``) through every defaults list, taking **every option** of each config group it
reaches (a user may pick any of them), the dataclass-generated nodes of
:mod:`experiments.config.planner_nodes` included, and the top-level groups the primary config does not select
(``experiment``), each placed at the package Hydra composes it into. A key added to any yaml or settings
dataclass is therefore known at once. Each dotted key records the kinds of default it takes (``bool``,
``int``, ``float``, ``str``, ``null``, ``map``, ``list``, ``interp`` for an interpolation):

* :func:`override_problems` checks command-line overrides before Hydra composes them (an unknown group
  option, ``planner=bogus``, or a key no option holds, named with the closest known key), so every entry
  point refuses them with one line and exit status 2 instead of Hydra's traceback;
* a composed config's keys and types are not checked here: the run spec is
  (:func:`experiments.config.spec.build_spec`, OmegaConf's structured configs), once, at the entry.

The ``hydra`` node is Hydra's own and is left to it. Package rules followed (Hydra 1.3, "The Defaults List"):
a group's default package is its group path; ``@pkg`` in a defaults list is relative to the containing
config's package, ``@_here_`` is that package, ``_global_`` the root; a ``# @package _global_`` header
places a file at the root.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import yaml
from hydra import initialize_config_dir
from hydra.core.default_element import ConfigDefault, GroupDefault
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from experiments.config.resolvers import RESOLVER, default_of

__all__ = [
    "GRAMMAR_DOC",
    "ConfigSchema",
    "config_schema",
    "override_problems",
    "parse_problems",
    "yaml_problem",
]

HYDRA_NODE = "hydra"
"""Hydra's own node (and its ``hydra/...`` groups): checked by Hydra, not here."""


@dataclass(frozen=True)
class ConfigSchema:
    """Every dotted key of the run config and the kinds of default it takes (module docstring)."""

    kinds: Mapping[str, frozenset[str]]
    """dotted key -> kinds of its defaults over every option that holds it."""
    groups: Mapping[str, tuple[str, ...]]
    """config group path (``planner``, ``planner/reorder``, ``hydra/launcher``) -> its options, sorted."""
    broken: Mapping[str, str] = field(default_factory=dict)
    """config path (``experiment/foo``) -> why it could not be read (:func:`yaml_problem`): left out of
    the walk, so a malformed option no run chooses breaks nothing; a run that chooses it is refused when
    Hydra composes it, naming the file."""

    def is_flag(self, key: str) -> bool:
        """Whether every default of ``key`` is a boolean (``null`` allowed beside it)."""
        kinds = self.kinds.get(key, frozenset())
        return "bool" in kinds and kinds <= {"bool", "null"}

    def known(self, key: str) -> bool:
        """Whether ``key`` can be in a composed config: a schema key, or inside a node whose default is not
        a mapping (an open value, e.g. an interpolation or ``null`` that a user may replace by a mapping)."""
        if key in self.kinds:
            return True
        parts = key.split(".")
        for i in range(len(parts) - 1, 0, -1):
            parent = ".".join(parts[:i])
            if parent in self.kinds:
                return not self.kinds[parent] <= {"map"}
        return False

    def closest(self, key: str) -> str | None:
        """The known key nearest to ``key`` (its siblings first), for "did you mean" messages."""
        parent = key.rpartition(".")[0]
        siblings = [k for k in self.kinds if k.rpartition(".")[0] == parent]
        for pool in (siblings, list(self.kinds)):
            match = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
            if match:
                return match[0]
        return None

    def suggestion(self, key: str) -> str:
        near = self.closest(key)
        return f"; the closest known key is {near}" if near else ""


DEFAULT_REF = re.compile(r"\$\{" + RESOLVER + r":([A-Za-z0-9_.]+)\}")
"""A yaml value that names the code's default of a key (``${default:simulator.history_window}``)."""


def _kind(value: Any) -> str:
    """The kind of one yaml default (module docstring); ``${default:KEY}`` takes the kind of the code's
    default it names (:mod:`experiments.config.resolvers`)."""
    if isinstance(value, str) and (ref := DEFAULT_REF.fullmatch(value)):
        return _kind(default_of(ref.group(1)))
    if isinstance(value, Mapping):
        return "map"
    if isinstance(value, list | tuple):
        return "list"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "interp" if "${" in str(value) else "str"


def _add(kinds: dict[str, set[str]], package: str, node: Any) -> None:
    """Record every key of the plain mapping ``node`` placed at ``package`` (``defaults`` left out)."""
    if not isinstance(node, Mapping):
        return
    for name, value in node.items():
        if name == "defaults" or (not package and name == HYDRA_NODE):
            continue
        key = f"{package}.{name}" if package else str(name)
        kinds.setdefault(key, set()).add(_kind(value))
        _add(kinds, key, value)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _child_package(parent: str, package: str | None, group: str) -> str:
    """The package of a defaults-list entry of a config at ``parent`` (module docstring, package rules)."""
    if package is None:
        package = group.replace("/", ".")
    if package in ("", "_here_"):
        return parent
    if package.startswith("_global_"):
        return package.removeprefix("_global_").lstrip(".")
    return _join(parent, package)


class _Walker:
    """Walks the repository from one config down its defaults lists (see :func:`config_schema`)."""

    def __init__(self, repo: Any) -> None:
        self.repo = repo
        self.kinds: dict[str, set[str]] = {}
        self.groups: dict[str, tuple[str, ...]] = {}
        self.seen: set[tuple[str, str]] = set()
        self.broken: dict[str, str] = {}

    def options(self, group: str) -> tuple[str, ...]:
        if group not in self.groups:
            self.groups[group] = tuple(sorted(self.repo.get_group_options(group, ObjectType.CONFIG)))
        return self.groups[group]

    def walk(self, path: str, package: str) -> None:
        if (path, package) in self.seen:
            return
        self.seen.add((path, package))
        try:
            result = self.repo.load_config(path)
        except yaml.YAMLError as exc:
            self.broken[path] = yaml_problem(exc)
            return
        if result is None:
            return
        header = (result.header or {}).get("package")
        if header == "_global_":
            package = ""
        elif header not in (None, "_group_"):
            package = str(header)
        group = path.rpartition("/")[0]
        parts = package.split(".") if package else []
        for i in range(1, len(parts) + 1):  # the package's own nodes (``planner``, ``planner.replicate``)
            self.kinds.setdefault(".".join(parts[:i]), set()).add("map")
        _add(self.kinds, package, OmegaConf.to_container(result.config, resolve=False))
        for entry in result.defaults_list or []:
            if isinstance(entry, GroupDefault):
                name = str(entry.group)
                if name.startswith(HYDRA_NODE):
                    continue
                child = name.lstrip("/") if name.startswith("/") else "/".join(p for p in (group, name) if p)
                where = _child_package(package, entry.package, name.lstrip("/"))
                for option in self.options(child):
                    self.walk(f"{child}/{option}", where)
            elif isinstance(entry, ConfigDefault) and entry.path != "_self_":
                given = str(entry.path)
                rel = given.lstrip("/")
                child = rel if given.startswith("/") else "/".join(p for p in (group, rel) if p)
                self.walk(child, _child_package(package, entry.package, rel.rpartition("/")[0]))


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A malformed YAML file's error on one line: the file, where, and what (PyYAML's marks)."""
    mark = getattr(exc, "problem_mark", None)
    what = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if mark is None:
        return f"not valid YAML ({what})"
    return f"{mark.name}: not valid YAML at line {mark.line + 1}, column {mark.column + 1} ({what})"


def _schema_from(repo: Any, primary: str) -> ConfigSchema:
    walker = _Walker(repo)
    walker.walk(primary, "")
    if primary in walker.broken:  # NOTE: nothing can be composed; Hydra's compose names the same file
        return ConfigSchema({}, {}, dict(walker.broken))
    primary_defaults = repo.load_config(primary).defaults_list or []
    selected = {g.group for g in primary_defaults if isinstance(g, GroupDefault)}
    for group in sorted(repo.get_group_options("", ObjectType.GROUP)):
        if group == HYDRA_NODE:
            continue
        if group not in selected:  # e.g. experiment: selected with +experiment=NAME
            for option in walker.options(group):
                walker.walk(f"{group}/{option}", group)
    for group in ("hydra/launcher",):  # NOTE: listed for override_problems only; their keys are Hydra's
        walker.options(group)
    kinds = {k: frozenset(v) for k, v in sorted(walker.kinds.items())}
    return ConfigSchema(kinds, dict(walker.groups), dict(walker.broken))


@lru_cache(maxsize=1)
def config_schema() -> ConfigSchema:
    """The schema of ``experiments/conf/config.yaml`` and everything it can compose (module docstring)."""
    import experiments  # noqa: F401 - registers the dataclass-generated nodes before the walk
    from experiments.config.presets import CONF_DIR

    hydra = GlobalHydra.instance()
    if hydra.is_initialized():
        return _schema_from(hydra.config_loader().repository, "config")  # type: ignore[attr-defined]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return _schema_from(GlobalHydra.instance().config_loader().repository, "config")  # type: ignore[attr-defined]


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every key in plain mapping ``node``, mappings included, ``hydra`` left out."""
    if not isinstance(node, Mapping):
        return
    for name, value in node.items():
        if not prefix and name == HYDRA_NODE:
            continue
        key = f"{prefix}.{name}" if prefix else str(name)
        yield key, value
        yield from _leaves(value, key)


def _values(override: Any) -> list[str]:
    """The value(s) of one parsed override as strings (each choice of a sweep)."""
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    return [override.get_value_element_as_str()]


GRAMMAR_DOC = "https://hydra.cc/docs/advanced/override_grammar/basic/"
"""Hydra's override grammar, named in the refusal of an override it cannot parse."""


def parse_problems(overrides: Sequence[str]) -> tuple[list[str], list[Any]]:
    """(a problem naming each override Hydra's grammar cannot parse, the parsed others).

    Each override is parsed on its own, so the message names the one at fault; Hydra's own message is
    several lines (the reason, a caret line, a link), here folded into one."""
    parser = OverridesParser.create()
    problems: list[str] = []
    parsed: list[Any] = []
    for text in overrides:
        try:
            parsed.extend(parser.parse_overrides([text]))
        except HydraException as exc:
            reason = " ".join(
                line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("See ")
            )
            problems.append(f"{text!r}: not a valid override ({reason}; the grammar: {GRAMMAR_DOC})")
    return problems, parsed


def override_problems(overrides: Sequence[str], schema: ConfigSchema | None = None) -> list[str]:
    """Problems of command-line ``overrides`` Hydra would refuse, or that set a key nothing reads.

    A group override (``planner=NAME``, also each choice of ``planner=a,b``) must name an option of its
    group; a key override (``KEY=V``, ``+KEY=V``, ``++KEY=V``) must name a known key. ``hydra.*`` and
    ``hydra/...`` overrides are left to Hydra, apart from the launcher's option. An override Hydra's grammar
    cannot parse (``seed=[``) is named with the parser's reason on one line.
    """
    schema = schema or config_schema()
    problems, parsed = parse_problems(overrides)
    for override in parsed:
        if override.is_delete():
            continue
        name = override.key_or_group
        group = name.replace(".", "/") if name.replace(".", "/") in schema.groups else None
        if group is None and name.startswith(HYDRA_NODE):
            continue
        if group is not None and override.package is None:
            options = schema.groups[group]
            for value in _values(override):
                if value not in options and value != "null":
                    near = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
                    hint = f"; the closest is {near[0]}" if near else ""
                    problems.append(
                        f"{name}={value}: no such {group} option (choose one of {', '.join(options)}){hint}"
                    )
            continue
        if not schema.known(name):
            problems.append(f"{name}: unknown key, nothing reads it{schema.suggestion(name)}")
    return problems
