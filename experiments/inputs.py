"""A run's per-sample counts and workload, memoised per process (read-only arrays).

Every planner's cell of one (model, dataset, seed, steps, rollouts) computes the same counts, and every
planner of one EP size and routing the same workload (the layout depends on the tokens only; docs/spine.md,
"Sample layout"), yet generating them is a tenth to a third of a cell's time at the paper's scale. A worker
process that computes several such cells (``experiments.reproduce`` hands them out grouped by
:func:`trace_key`) builds them once: :func:`cell_inputs` keeps the last :data:`CACHE_SIZE` counts and
workloads in small LRU caches, keyed by exactly the config values they are a function of.

A cached array is shared by every later cell of the process, so each one is made read-only
(``writeable=False``) before it is handed out: a planner, bound or simulator stage that wrote into its
input would raise instead of changing the next cell's numbers. ``SampleCounts.meta`` (a dict) is copied
for every caller. :func:`cell_inputs` with ``cache=False`` computes without the caches (same values).

:func:`trained_inputs` gives the routes the training step takes where ``replay.mismatch`` > 0 (routing replay
off or partial, :mod:`relibra.trace.mismatch`): the trace's counts with that share of slots re-drawn from the
run's seed, laid out as the replayed workload (the layout depends on the tokens only), cached beside them.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from experiments.config.build import build_workload_for, load_counts, routing
from experiments.config.spec import RunSpec
from relibra.trace.mismatch import trained_counts
from relibra.trained_routes import TrainedRoutes
from relibra.types import SampleCounts, Workload

__all__ = [
    "CACHE_SIZE",
    "CacheStats",
    "cache_stats",
    "cell_inputs",
    "clear_cache",
    "replay_mismatch",
    "trace_key",
    "trained_inputs",
]

CACHE_SIZE = 2
"""Counts (and, separately, workloads) kept per process. A paper-scale entry is up to ~100 MB (Qwen3-235B:
2048 samples x 94 layers x 128 experts int32), so a worker holds at most a few hundred MB."""

TraceKey = tuple[Any, ...]


def trace_key(spec: RunSpec) -> TraceKey:
    """What the run's counts are a function of: the trace file's path, or the generator's arguments.

    The same values :func:`experiments.config.build.load_counts` reads; cells with equal keys share counts.
    """
    trace, model = spec.trace, spec.model
    if trace.path:
        return ("file", trace.path)
    return (
        "synthetic",
        trace.preset,
        model.num_experts,
        model.num_moe_layers,
        model.top_k,
        trace.num_batches,
        trace.samples_per_batch,
        spec.seed,
        trace.max_tokens,
    )


def _workload_key(spec: RunSpec, num_gpus: int) -> tuple[Any, ...]:
    """What :func:`experiments.config.build.build_workload_for` reads besides the counts."""
    uniform = routing(spec) == "uniform"
    return (
        routing(spec),
        spec.seed if uniform else None,  # NOTE: only uniform routing draws from the seed
        num_gpus,
        spec.workload.samples_per_microbatch,
        spec.workload.tokens_per_microbatch,
        spec.workload.layout,
        spec.model.attention_span,  # NOTE: the layout and the attention pairs read it
        (spec.parallel.tp, spec.parallel.cp),  # NOTE: the samples' split over a TP x CP group
    )


def _file_version(key: TraceKey) -> tuple[Any, ...]:
    """(mtime, size) of a trace file, so that a file replaced between cells is read again."""
    if key[0] != "file":
        return ()
    stat = Path(key[1]).stat()
    return (stat.st_mtime_ns, stat.st_size)


def _freeze(arrays: tuple[np.ndarray | None, ...]) -> None:
    for array in arrays:
        if array is not None:
            array.flags.writeable = False


def _freeze_counts(counts: SampleCounts) -> SampleCounts:
    _freeze((counts.counts, counts.tokens, counts.batch_offsets, counts.sample_domain))
    return counts


def _freeze_workload(workload: Workload) -> Workload:
    _freeze(
        (
            workload.load,
            workload.tokens,
            workload.causal_pairs,
            workload.sample_gpu,
            workload.sample_mb,
            workload.mb_batch,
        )
    )
    return workload


@dataclass
class _LRU:
    """The last ``size`` values by key, with hit and miss counts (functools.lru_cache keys by every
    argument; here the key is chosen explicitly, and the config that builds a value is not part of it)."""

    size: int
    entries: OrderedDict[tuple[Any, ...], Any] = field(default_factory=OrderedDict)
    hits: int = 0
    misses: int = 0

    def get(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        if key in self.entries:
            self.hits += 1
            self.entries.move_to_end(key)
            return self.entries[key]
        self.misses += 1
        value = build()
        self.entries[key] = value
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self.entries.clear()
        self.hits = self.misses = 0


_COUNTS = _LRU(CACHE_SIZE)
_WORKLOADS = _LRU(CACHE_SIZE)
_TRAINED = _LRU(CACHE_SIZE)


def cell_inputs(spec: RunSpec, num_gpus: int, cache: bool = True) -> tuple[SampleCounts, Workload]:
    """The run's counts [S, L, E] (uniformly re-routed for force-balanced) and workload [M, L, G, E].

    ``cache``: from this process's caches (read-only arrays, built on a miss); False: built afresh, as
    ``build_workload_for(spec, load_counts(spec), num_gpus)``. Call it on a checked config (a trace file
    that is missing raises FileNotFoundError).
    """
    if not cache:
        return build_workload_for(spec, load_counts(spec), num_gpus)
    key = trace_key(spec)
    tkey = (*key, *_file_version(key))

    def counts() -> SampleCounts:
        return _freeze_counts(load_counts(spec))

    def inputs() -> tuple[SampleCounts, Workload]:
        given, workload = build_workload_for(spec, _COUNTS.get(tkey, counts), num_gpus)
        return _freeze_counts(given), _freeze_workload(workload)

    shared, workload = _WORKLOADS.get((*tkey, *_workload_key(spec, num_gpus)), inputs)
    return replace(shared, meta=copy.deepcopy(shared.meta)), workload


def replay_mismatch(spec: RunSpec) -> float:
    """The run's ``replay.mismatch`` (checked: a number in [0, 1]); 0 for force-balanced, whose uniform
    routing is its definition, not a replay of the trace."""
    if routing(spec) == "uniform":
        return 0.0
    return spec.replay.mismatch


def trained_inputs(spec: RunSpec, num_gpus: int, cache: bool = True) -> TrainedRoutes | None:
    """The routes the training step takes (:class:`~relibra.trained_routes.TrainedRoutes`) when
    :func:`replay_mismatch` is above 0, else None (exact replay: the trained routes are the replayed ones).

    ``cache``: as :func:`cell_inputs`. Call it on a checked config.
    """
    mismatch = replay_mismatch(spec)
    if mismatch == 0.0:
        return None

    def build(replayed: SampleCounts) -> TrainedRoutes:
        whole = trained_counts(replayed, mismatch, spec.seed)
        counts, workload = build_workload_for(spec, whole, num_gpus)
        return TrainedRoutes(_freeze_counts(counts), _freeze_workload(workload))

    if not cache:
        return build(load_counts(spec))
    key = trace_key(spec)
    tkey = (*key, *_file_version(key))

    def cached() -> TrainedRoutes:
        return build(_COUNTS.get(tkey, lambda: _freeze_counts(load_counts(spec))))

    trained: TrainedRoutes = _TRAINED.get(
        (*tkey, *_workload_key(spec, num_gpus), mismatch, spec.seed), cached
    )
    return trained


class CacheStats(NamedTuple):
    """Lookups of this process's caches since it started (or since :func:`clear_cache`)."""

    counts_hits: int
    counts_misses: int
    workload_hits: int
    workload_misses: int


def cache_stats() -> CacheStats:
    """Hits and misses of the counts and workload caches of this process."""
    return CacheStats(_COUNTS.hits, _COUNTS.misses, _WORKLOADS.hits, _WORKLOADS.misses)


def clear_cache() -> None:
    """Empty both caches (and their statistics)."""
    _COUNTS.clear()
    _WORKLOADS.clear()
    _TRAINED.clear()
