"""The per-process cache of a run's counts and workload: hits, read-only arrays, keys, equal results."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from experiments import inputs, run
from experiments.config.build import build_workload_for, load_counts
from experiments.config.checks import check_config
from experiments.config.presets import CONF_DIR
from experiments.config.spec import build_spec

SMALL = [
    "model=qwen3-30b-a3b",
    "trace.preset=mixed",
    "cluster.nodes=2",
    "trace.num_batches=2",
    "trace.samples_per_batch=32",
    "trace.max_tokens=256",
    "logger=none",
]
PINNED = ("step_time_s", "skew_mean", "reorder_moved_experts", "t_comm_s", "t_compute_s")
"""Deterministic result columns (as scripts/pin_cells.py; the planning times are wall time)."""


def _cfg(*overrides: str) -> DictConfig:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="test"):
        return compose("config", overrides=[*SMALL, *overrides])


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    inputs.clear_cache()
    yield
    inputs.clear_cache()


def _arrays(counts: object, workload: object) -> list[np.ndarray]:
    names = ("counts", "tokens", "batch_offsets", "sample_domain")
    wnames = ("load", "tokens", "causal_pairs", "sample_gpu", "sample_mb", "mb_batch")
    return [getattr(counts, n) for n in names] + [getattr(workload, n) for n in wnames]


def test_a_hit_returns_the_same_read_only_arrays_equal_to_a_fresh_build() -> None:
    cfg = _cfg("planner=megatron")
    counts, workload = inputs.cell_inputs(build_spec(cfg), 16)
    again, workload_again = inputs.cell_inputs(
        build_spec(_cfg("planner=relibra")), 16
    )  # another planner: same inputs
    assert inputs.cache_stats() == inputs.CacheStats(0, 1, 1, 1)
    assert again.counts is counts.counts and workload_again is workload
    fresh_counts, fresh_workload = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), 16)
    for cached, fresh in zip(_arrays(counts, workload), _arrays(fresh_counts, fresh_workload), strict=True):
        assert not cached.flags.writeable
        np.testing.assert_array_equal(cached, fresh)
        assert cached.dtype == fresh.dtype
    with pytest.raises(ValueError, match="read-only"):
        workload.load[0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="read-only"):
        counts.counts[0] = 0
    counts.meta["planner_wrote"] = True  # NOTE: meta is a dict; every caller gets its own copy
    assert "planner_wrote" not in inputs.cell_inputs(build_spec(cfg), 16)[0].meta


@pytest.mark.parametrize(
    ("overrides", "num_gpus", "counts_differ"),
    [
        (["seed=1"], 16, True),
        (["trace.preset=reasoning"], 16, True),
        (["trace.samples_per_batch=48"], 16, True),
        (["model=glm4.5-106b-a12b"], 16, True),
        ([], 8, False),
        (["planner=force_balanced"], 16, False),  # uniform routing: other counts from the same trace
        (["workload.samples_per_microbatch=1"], 16, False),
    ],
)
def test_different_keys_do_not_collide(overrides: list[str], num_gpus: int, counts_differ: bool) -> None:
    base_counts, base = inputs.cell_inputs(build_spec(_cfg()), 16)
    cfg = _cfg(*overrides)
    counts, workload = inputs.cell_inputs(build_spec(cfg), num_gpus)
    stats = inputs.cache_stats()
    assert stats.workload_misses == 2  # a new workload key
    assert stats.counts_misses == (2 if counts_differ else 1)
    fresh_counts, fresh = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), num_gpus)
    np.testing.assert_array_equal(counts.counts, fresh_counts.counts)
    np.testing.assert_array_equal(workload.load, fresh.load)
    assert workload is not base
    shared = not counts_differ and "planner=force_balanced" not in overrides
    assert (counts.counts is base_counts.counts) == shared  # the trace's counts, or others
    same_shape = base.load.shape == workload.load.shape
    assert not (same_shape and np.array_equal(base.load, workload.load))


def test_a_sliding_window_is_its_own_workload() -> None:
    """Same counts, other attention pairs: a model with a sliding window gets its own workload."""
    base_counts, base = inputs.cell_inputs(build_spec(_cfg()), 16)
    cfg = _cfg("model.attention_window=16", "model.windowed_layers=24")
    counts, workload = inputs.cell_inputs(build_spec(cfg), 16)
    assert counts.counts is base_counts.counts and workload is not base
    _, fresh = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), 16)
    np.testing.assert_array_equal(workload.causal_pairs, fresh.causal_pairs)
    assert (workload.causal_pairs.sum(axis=1) < base.causal_pairs.sum(axis=1)).all()


def test_the_cache_keeps_only_its_last_entries() -> None:
    for seed in range(inputs.CACHE_SIZE + 1):
        inputs.cell_inputs(build_spec(_cfg(f"seed={seed}")), 16)
    inputs.cell_inputs(build_spec(_cfg("seed=0")), 16)  # the oldest was dropped: built again
    assert inputs.cache_stats().counts_misses == inputs.CACHE_SIZE + 2


def test_a_replaced_trace_file_is_read_again(tmp_path: Path) -> None:
    from relibra.trace.format import save_trace
    from relibra.trace.synthetic import generate_trace

    def trace(seed: int) -> None:
        save_trace(generate_trace("mixed", 64, 16, 8, 1, 8, seed=seed, max_tokens=16), tmp_path / "t.npz")

    trace(0)
    cfg = _cfg("model=olmoe-1b-7b", "cluster.nodes=1", f"trace.path={tmp_path / 't.npz'}")
    first = inputs.cell_inputs(build_spec(cfg), 8)[0].counts.copy()
    trace(1)
    second = inputs.cell_inputs(build_spec(cfg), 8)[0].counts
    np.testing.assert_array_equal(second, load_counts(build_spec(cfg)).counts)
    assert not np.array_equal(first, second)


# NOTE: the ReLibra case (about 24 s) runs in `make test-slow`; ReLibra's cells with the cache are also
# compared in test_cells_in_one_process_do_not_depend_on_their_order.
@pytest.mark.parametrize(
    "planner", [pytest.param("relibra", marks=pytest.mark.slow), "force_balanced", "llep", "eplb"]
)
def test_a_cell_computed_with_the_cache_equals_one_without(
    planner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _cfg(f"planner={planner}")
    inputs.cell_inputs(build_spec(_cfg("planner=megatron")), 16)  # the cell below finds its inputs cached
    cached, cached_layers, _ = run.compute(check_config(cfg))
    assert inputs.cache_stats().workload_hits == (0 if planner == "force_balanced" else 1)
    monkeypatch.setattr(run, "cell_inputs", functools.partial(inputs.cell_inputs, cache=False))
    fresh, fresh_layers, _ = run.compute(check_config(cfg))
    cols = [c for c in PINNED if c in fresh]
    assert cols
    assert cached[cols].equals(fresh[cols])
    assert cached_layers.equals(fresh_layers)


@pytest.mark.slow
def test_no_numba_kernel_is_compiled_for_read_only_inputs() -> None:
    """Cached arrays are read-only; a kernel handed one would compile a second (read-only) signature in
    every worker. The planners copy or convert what they pass to their kernels."""
    from numba.core.registry import CPUDispatcher

    planners = sorted(p.stem for p in (CONF_DIR / "planner").glob("*.yaml") if p.stem != "relibra_milp")
    for planner in planners:  # NOTE: without the MILP planner, which solves under a wall-clock limit
        run.compute(check_config(_cfg(f"planner={planner}")))
    read_only = sorted(
        f"{value.py_func.__module__}.{value.py_func.__name__}{sig}"
        for module in list(sys.modules.values())
        for value in list(getattr(module, "__dict__", {}).values())
        if type(value) is CPUDispatcher
        for sig in value.signatures
        if any("readonly" in str(arg) for arg in sig)
    )
    assert read_only == []


ORDERED_CELLS = (
    ("planner=relibra",),
    ("planner=foremoe", "cluster.dispatcher=deepep"),
    ("planner=relibra", "cluster.dispatcher=deepep"),
    ("planner=relibra_portfolio", "trace.preset=coding"),
    ("planner=ultraep", "seed=1"),
)
"""Cells of several planners, dispatchers, datasets and seeds that share inputs, as one grid worker gets."""


@pytest.mark.parametrize(
    "ordered",
    [
        # NOTE: the default run keeps three cells (three planners, both dispatchers, two seeds); all five
        # (about 55 s) run in `make test-slow`
        pytest.param(ORDERED_CELLS[1:3] + ORDERED_CELLS[4:], id="three"),
        pytest.param(ORDERED_CELLS, id="five", marks=pytest.mark.slow),
    ],
)
def test_cells_in_one_process_do_not_depend_on_their_order(ordered: tuple[tuple[str, ...], ...]) -> None:
    """One worker computes many cells: no state carried from a cell to the next (caches, planner or kernel
    state) may change a result. The cells in grid order, then reversed after emptying the caches, give the
    same deterministic columns and per-layer tables to the last bit."""

    def computed() -> dict[tuple[str, ...], tuple[object, object]]:
        out = {}
        for cell in order:
            rows, layers, _ = run.compute(check_config(_cfg(*cell)))
            out[cell] = (rows[[c for c in PINNED if c in rows]], layers)
        return out

    inputs.clear_cache()
    order = list(ordered)
    forward = computed()
    assert inputs.cache_stats().workload_hits > 0  # the cells shared their inputs
    inputs.clear_cache()
    order.reverse()
    backward = computed()
    for cell in ordered:
        (rows_f, layers_f), (rows_b, layers_b) = forward[cell], backward[cell]
        assert rows_f.equals(rows_b), cell
        assert layers_f.equals(layers_b), cell
