"""Cells that read a trace file are keyed by the trace's content, never by its path."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import experiments.store.cell_files as store_module
from experiments.config.spec import RunSpec
from experiments.grid.runner import plan_grid
from experiments.run import run
from experiments.store.keys import (
    IGNORED_KEYS,
    TRACE_DIGEST,
    _drop,
    cell_key,
    keyed_earlier,
    path_keyed,
    stored_keys,
)
from experiments.store.results_store import ResultsStore
from experiments.store.trace_digest import TraceDigestError, trace_digest
from relibra.trace.format import RoutingTrace, save_trace
from tests.builders import cfg
from tests.experiments.test_store import CONFIG

R = ["model=olmoe-1b-7b", "cluster.nodes=1", "cluster.gpus_per_node=8", "planner=megatron"]
"""The issue's small run (one 8-GPU node, OLMoE's 64 experts, top-8, 16 layers), Megatron-LM's placement."""
TOKENS, SAMPLES = 32, 16


def _trace(path: Path, hot: bool) -> Path:
    """16 samples of 32 tokens through 16 layers: each token's 8 experts on one GPU, the GPUs in turn
    (``hot=False``: every GPU gets the same tokens) or every token on experts 0-7 (one GPU gets them all)."""
    tokens = np.arange(TOKENS * SAMPLES)
    first = np.zeros_like(tokens) if hot else (tokens % 8) * 8
    experts = (first[:, None, None] + np.arange(8)[None, None, :]).repeat(16, axis=1).astype(np.int16)
    meta = {"num_experts": 64, "top_k": 8, "num_layers": 16, "model": "olmoe-1b-7b", "source": "test"}
    trace = RoutingTrace(
        experts=experts,
        sample_offsets=np.arange(0, TOKENS * (SAMPLES + 1), TOKENS, dtype=np.int64),
        batch_offsets=np.array([0, SAMPLES], dtype=np.int64),
        meta=meta,
    )
    return save_trace(trace, path)


def _same_stat(path: Path, like: os.stat_result) -> None:
    os.utime(path, ns=(like.st_atime_ns, like.st_mtime_ns))


def test_a_synthetic_cells_key_is_the_one_the_store_always_gave_it() -> None:
    """No trace file: the key is the hash of the config as before content keys (stores keep their cells)."""
    assert cell_key(CONFIG) == _old_key(CONFIG) == "dda4d31158dc5de5"


def test_the_key_follows_the_traces_content_not_its_path(tmp_path: Path) -> None:
    uniform, hot = _trace(tmp_path / "u.npz", hot=False), _trace(tmp_path / "h.npz", hot=True)
    trace = tmp_path / "T.npz"
    shutil.copyfile(uniform, trace)
    key = cell_key(cfg(*R, f"trace.path={trace}"))
    moved = tmp_path / "elsewhere" / "moved.npz"
    moved.parent.mkdir()
    shutil.copyfile(trace, moved)
    assert cell_key(cfg(*R, f"trace.path={moved}")) == key  # another path, the same arrays
    before = trace.stat()
    shutil.copyfile(hot, trace)  # NOTE: the same size; and the same mtime, as `cp -p` would leave it
    _same_stat(trace, before)
    assert trace.stat().st_size == before.st_size and trace.stat().st_mtime_ns == before.st_mtime_ns
    assert cell_key(cfg(*R, f"trace.path={trace}")) != key


def test_the_digest_is_of_the_arrays_not_of_the_zip(tmp_path: Path) -> None:
    """The same arrays compressed or not (a re-saved file) give one digest; a missing file is named."""
    plain = _trace(tmp_path / "plain.npz", hot=False)
    with np.load(plain) as arrays:
        np.savez_compressed(tmp_path / "packed.npz", **{k: arrays[k] for k in arrays.files})
    assert (tmp_path / "packed.npz").read_bytes() != plain.read_bytes()
    assert trace_digest(tmp_path / "packed.npz") == trace_digest(plain)
    with pytest.raises(TraceDigestError, match=r"nothing\.npz"):
        trace_digest(tmp_path / "nothing.npz")


def test_a_trace_replaced_at_its_path_is_computed_again(tmp_path: Path) -> None:
    """The issue's probe: a store must not serve the uniform trace's numbers for the hot one."""
    trace = tmp_path / "T.npz"
    _trace(trace, hot=False)
    store = tmp_path / "S"
    first = run(cfg(*R, f"trace.path={trace}", f"+results_dir={store}"), run_dir=tmp_path / "r1")
    assert first["skew_mean"].item() < 1.1
    # NOTE: a plain copy (a new mtime): the caches of one process (experiments.config.build.read_trace,
    # experiments.inputs) are keyed by (mtime, size); the key's digest is checked on any change.
    shutil.copyfile(_trace(tmp_path / "hot.npz", hot=True), trace)
    second = run(cfg(*R, f"trace.path={trace}", f"+results_dir={store}"), run_dir=tmp_path / "r2")
    assert second["skew_mean"].item() == pytest.approx(8.0)
    assert json.loads((tmp_path / "r2" / "summary.json").read_text())["reused_from"] is None
    assert len(ResultsStore(store).keys()) == 2


def test_a_moved_store_with_its_trace_reuses_its_cells(tmp_path: Path) -> None:
    """A store and its trace moved elsewhere (the reproduce layout: RESULTS/traces, RESULTS/<preset>)."""
    root = tmp_path / "a"
    trace = _trace(root / "traces" / "t.npz", hot=True)
    computed = run(cfg(*R, f"trace.path={trace}", f"+results_dir={root / 'p'}"), run_dir=tmp_path / "r1")
    shutil.move(root, tmp_path / "b")
    moved = tmp_path / "b"
    again = run(
        cfg(*R, f"trace.path={moved / 'traces' / 't.npz'}", f"+results_dir={moved / 'p'}"),
        run_dir=tmp_path / "r2",
    )
    assert json.loads((tmp_path / "r2" / "summary.json").read_text())["reused_from"] is not None
    pd.testing.assert_frame_equal(again.drop(columns="trace"), computed.drop(columns="trace"))


def _old_key(config: dict) -> str:
    """The key the suite before content keys gave ``config`` (its trace's path in the hash)."""
    text = json.dumps(_drop(config, IGNORED_KEYS), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _write_path_keyed(store: ResultsStore, config: dict, rows: pd.DataFrame) -> str:
    """Store ``rows`` as the suite before content keys did: the config as given, under its path's key."""
    key = _old_key(config)
    meta = {
        store_module._KEY_META: key.encode(),
        store_module._CONFIG_META: json.dumps(config, sort_keys=True, default=str).encode(),
        store_module._CHECKSUM_META: store_module.content_checksum(rows).encode(),
    }
    store_module.atomic_write_parquet(rows, store.cell_path(key), meta)
    return key


ROWS = pd.DataFrame({"planner": ["megatron"], "step_time_s": [1.0]})


def test_a_cell_keyed_by_its_path_by_older_code_still_reads_as_its_own(tmp_path: Path) -> None:
    """A cell stored before content keys verifies under its old key (it is not corrupt) and is known as
    path-keyed; a cell stored now holds its trace's digest."""
    trace = _trace(tmp_path / "t.npz", hot=False)
    config = {**CONFIG, "trace": {"path": str(trace)}}
    store = ResultsStore(tmp_path / "s")
    new_key = cell_key(config)
    store.write(new_key, ROWS, config)
    stored = store.config(new_key)
    assert stored["trace"][TRACE_DIGEST] == trace_digest(trace) and not path_keyed(stored)
    old_key = _write_path_keyed(store, config, ROWS)
    assert old_key != new_key
    assert path_keyed(store.config(old_key))
    pd.testing.assert_frame_equal(store.read(old_key), ROWS)


def test_reproduce_says_cells_keyed_by_their_path_are_computed_again(tmp_path: Path) -> None:
    """A grid recorded before content keys: its path-keyed cells are counted apart (not blamed on "a
    changed setting") and the grid's cells are jobs under their content keys."""
    trace = _trace(tmp_path / "t.npz", hot=False)
    overrides = ["model=olmoe-1b-7b", "cluster.nodes=1", "planner=megatron", f"trace.path={trace}"]
    root = tmp_path / "results"
    report, jobs = plan_grid("quick_ep_scaling", root, overrides)
    assert len(jobs) == report.total == 1 and report.rekeyed == 0
    store = ResultsStore(root / "quick_ep_scaling")
    assert isinstance(jobs[0].spec, RunSpec)
    old_key = _write_path_keyed(store, dict(jobs[0].spec.composed), ROWS)
    store.write_grid([old_key])
    report, jobs = plan_grid("quick_ep_scaling", root, overrides)
    assert (report.rekeyed, report.left_out, len(jobs)) == (1, 0, 1), report


def test_a_trace_path_that_is_no_regular_file_is_refused_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        with pytest.raises(TraceDigestError, match="not a regular file"):
            trace_digest(path)


def _peer_config(trace: Path, folder: str) -> dict:
    return {**CONFIG, "trace": {"path": str(trace)}, "peer": {"workload": "W0_balanced", "dir": folder}}


def test_a_peer_cell_keeps_its_key_when_its_trace_folder_moves(tmp_path: Path) -> None:
    """``peer.dir`` says where the peer trace is written (under the results root), not what the cell is:
    a store moved with its traces keeps its peer cells."""
    trace = _trace(tmp_path / "t.npz", hot=False)
    moved = tmp_path / "moved.npz"
    shutil.copy(trace, moved)
    assert cell_key(_peer_config(trace, str(tmp_path / "a"))) == cell_key(_peer_config(moved, "/elsewhere/b"))
    other = {**_peer_config(trace, "x"), "peer": {"workload": "W1_skewed", "dir": "x"}}
    assert cell_key(other) != cell_key(_peer_config(trace, "x"))


def test_a_peer_cell_keyed_with_its_folder_by_older_code_reads_as_its_own_and_is_redone(
    tmp_path: Path,
) -> None:
    """A peer cell written when ``peer.dir`` was in the key verifies under that key (not corrupt) and is
    known as keyed by an earlier rule; a cell written now is not."""
    trace = _trace(tmp_path / "t.npz", hot=False)
    config = _peer_config(trace, str(tmp_path / "traces"))
    store = ResultsStore(tmp_path / "s")
    new_key = cell_key(config)
    store.write(new_key, ROWS, config)
    stored = store.config(new_key)
    old_key = next(iter(stored_keys(stored) - {new_key}))
    meta = {
        store_module._KEY_META: old_key.encode(),
        store_module._CONFIG_META: json.dumps(stored, sort_keys=True, default=str).encode(),
        store_module._CHECKSUM_META: store_module.content_checksum(ROWS).encode(),
    }
    store_module.atomic_write_parquet(ROWS, store.cell_path(old_key), meta)
    pd.testing.assert_frame_equal(store.read(old_key), ROWS)
    assert keyed_earlier(store.config(old_key), old_key)
    assert not keyed_earlier(stored, new_key)
    with pytest.raises(store_module.CorruptCellError, match="does not hash to its key"):
        store_module.atomic_write_parquet(
            ROWS, store.cell_path("0" * 16), {**meta, store_module._KEY_META: b"0" * 16}
        )
        store.read("0" * 16)
