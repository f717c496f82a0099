"""Results store: cell keys, atomic writes, resume, and concurrent writers in separate processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from experiments.store.access import load_experiment, load_per_layer, run_cell
from experiments.store.cell_files import CorruptCellError
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore

CONFIG = {
    "model": {"name": "qwen3-30b-a3b", "num_experts": 128},
    "planner": {"name": "relibra", "replica_slots": 2},
    "cluster": {"nodes": 4, "gpus_per_node": 8},
    "seed": 0,
    "results_dir": "results/a",
    "logger": {"name": "none"},
    "hydra": {"run": {"dir": "outputs/x"}},
}


def _named(name: str) -> tuple[str, dict]:
    """A config of its own for a test cell called ``name``, and its key (a store refuses any other key)."""
    config = {**CONFIG, "seed": name}
    return cell_key(config), config


def _put(store: ResultsStore, name: str, rows: pd.DataFrame, per_layer: pd.DataFrame | None = None) -> str:
    key, config = _named(name)
    store.write(key, rows, config, per_layer)
    return key


def _rows(tag: int, n: int = 3) -> pd.DataFrame:
    return pd.DataFrame(
        {"planner": ["relibra"] * n, "tag": np.full(n, tag), "step_time_s": np.arange(n, dtype=float) + tag}
    )


def test_key_ignores_order_container_type_and_output_keys() -> None:
    reordered = {k: CONFIG[k] for k in reversed(list(CONFIG))}
    moved = {**CONFIG, "results_dir": "elsewhere", "logger": {"name": "wandb"}, "hydra": {}}
    assert cell_key(CONFIG) == cell_key(reordered) == cell_key(OmegaConf.create(CONFIG)) == cell_key(moved)


def test_key_changes_with_any_value_that_defines_the_cell() -> None:
    base = cell_key(CONFIG)
    for path, value in [("planner.replica_slots", 3), ("cluster.nodes", 8), ("seed", 1)]:
        cfg = OmegaConf.create(CONFIG)
        OmegaConf.update(cfg, path, value)
        assert cell_key(cfg) != base, path


def test_key_resolves_interpolations() -> None:
    cfg = OmegaConf.create({**CONFIG, "nodes_by_model": {"qwen3-30b-a3b": 4}})
    cfg.cluster.nodes = "${nodes_by_model[${model.name}]}"
    assert cell_key(cfg) == cell_key({**CONFIG, "nodes_by_model": {"qwen3-30b-a3b": 4}})


def test_write_then_read_round_trips_rows_config_and_per_layer(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    key = cell_key(CONFIG)
    layers = pd.DataFrame({"planner": ["relibra"] * 4, "microbatch": [0, 0, 1, 1], "layer": [0, 1, 0, 1]})
    assert not store.has(key)
    store.write(key, _rows(7), CONFIG, layers)
    assert store.has(key) and store.keys() == [key]
    pd.testing.assert_frame_equal(store.read(key), _rows(7))
    pd.testing.assert_frame_equal(store.read_per_layer(key), layers)
    assert store.config(key)["planner"] == CONFIG["planner"]
    loaded = load_experiment(tmp_path)
    assert list(loaded["cell"].unique()) == [key] and len(loaded) == 3
    assert len(load_per_layer(tmp_path)) == 4


def test_empty_results_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty results"):
        ResultsStore(tmp_path).write("k", pd.DataFrame(), CONFIG)


def test_crash_during_write_leaves_no_cell_and_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ResultsStore(tmp_path)

    def half_write(table, where, **kwargs):  # type: ignore[no-untyped-def]
        where.write(b"PAR1 partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(pq, "write_table", half_write)
    with pytest.raises(KeyboardInterrupt):
        store.write(cell_key(CONFIG), _rows(1), CONFIG)
    assert not store.has(cell_key(CONFIG))
    assert list(store.cells_dir.iterdir()) == []


def test_leftover_temp_files_are_ignored_and_cleaned(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    done = _put(store, "done", _rows(1))
    stale = store.cells_dir / ".tmp-crashed.parquet"
    stale.write_bytes(b"PAR1 truncated")
    assert store.keys() == [done]
    assert len(store.load()) == 3
    assert store.clean_stale(older_than_s=0.0) == 1 and not stale.exists()


def test_rerun_reuses_finished_cells_and_redoes_unfinished(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    calls: list[int] = []

    def compute() -> tuple[pd.DataFrame, None]:
        calls.append(1)
        return _rows(len(calls)), None

    first, reused_first = run_cell(store, CONFIG, compute)
    second, reused_second = run_cell(store, CONFIG, compute)
    assert (reused_first, reused_second) == (False, True) and len(calls) == 1
    pd.testing.assert_frame_equal(first, second)
    # an unfinished cell (a crashed writer left only its temp file) runs again
    other = {**CONFIG, "seed": 1}
    (store.cells_dir / f".tmp-{cell_key(other)}.parquet").write_bytes(b"x")
    _, reused_other = run_cell(store, other, compute)
    assert not reused_other and len(calls) == 2


def test_grid_manifest_hides_stale_cells(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    old = _put(store, "old", _rows(1))
    new = _put(store, "new", _rows(2))
    assert len(load_experiment(tmp_path)) == 6  # no grid.json: every cell on disk
    store.write_grid([new, "not-run-yet"])
    assert set(load_experiment(tmp_path)["cell"]) == {new}
    assert set(load_experiment(tmp_path, all_cells=True)["cell"]) == {old, new}


def _writer(root: str, writer: int, rounds: int) -> None:
    store = ResultsStore(Path(root))
    for i in range(rounds):
        tag = writer * 1000 + i
        # shared keys are written by every process; own keys by this one only
        _put(store, f"shared{i % 3}", _rows(tag, n=20_000))
        _put(store, f"own{writer}-{i}", _rows(tag, n=50))


def test_concurrent_writers_never_corrupt_the_store(tmp_path: Path) -> None:
    writers, rounds = 3, 8
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, rounds)) for w in range(writers)]
    for p in procs:
        p.start()
    store = ResultsStore(tmp_path)
    shared = {_named(f"shared{i}")[0] for i in range(3)}
    reads = 0
    deadline = time.time() + 60
    while any(p.is_alive() for p in procs) and time.time() < deadline:
        for key in store.keys():
            frame = store.read(key)  # must never be partial: one writer's whole frame
            assert frame["tag"].nunique() == 1
            assert len(frame) == (20_000 if key in shared else 50)
            reads += 1
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert reads > 0
    assert sorted(store.keys()) == sorted(
        shared | {_named(f"own{w}-{i}")[0] for w in range(writers) for i in range(rounds)}
    )
    assert not list(store.cells_dir.glob(".tmp-*"))
    assert len(store.load()) == 3 * 20_000 + writers * rounds * 50


# --- unreadable cells, claims, permissions, stale temporaries ----------------------------------------


def _truncate(path: Path, size: int = 1000) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(size)


def test_truncated_cell_is_named_counted_missing_and_recomputed(tmp_path: Path, caplog) -> None:
    store = ResultsStore(tmp_path)
    key = cell_key(CONFIG)
    run_cell(store, CONFIG, lambda: (_rows(1, n=500), None))
    _truncate(store.cell_path(key))
    with pytest.raises(CorruptCellError, match=re.escape(str(store.cell_path(key)))):
        store.read(key)
    with caplog.at_level("WARNING", logger="experiments.store"):
        assert store.load().empty  # left out, not an ArrowInvalid about a '<Buffer>'
    assert str(store.cell_path(key)) in caplog.text
    assert store.corrupt_keys() == [key]
    calls = []

    def compute():
        calls.append(1)
        return _rows(2), None

    rows, reused = run_cell(store, CONFIG, compute)
    assert (reused, len(calls)) == (False, 1)
    pd.testing.assert_frame_equal(store.read(key), rows)
    assert store.corrupt_keys() == []


def test_truncated_per_layer_file_is_left_out_of_loads(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    a = _put(store, "a", _rows(1), per_layer=_rows(1, n=500))
    b = _put(store, "b", _rows(2), per_layer=_rows(2))
    _truncate(store.per_layer_path(a))
    assert set(store.load_per_layer()["cell"]) == {b}


def test_a_cell_is_computed_once_by_concurrent_writers(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    log = tmp_path / "computed.log"
    procs = [ctx.Process(target=_claiming_writer, args=(str(tmp_path), str(log), w)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    assert len(log.read_text().splitlines()) == 1  # one writer computed, the others read it back
    assert len(ResultsStore(tmp_path).keys()) == 1


def _claiming_writer(root: str, log: str, writer: int) -> None:
    def compute():
        with open(log, "a") as fh:
            fh.write(f"{writer}\n")
        time.sleep(1.0)  # long enough that the other writers arrive while this one holds the claim
        return _rows(writer), None

    rows, _ = run_cell(ResultsStore(Path(root)), CONFIG, compute)
    assert len(rows) == 3
    # NOTE: leave without interpreter finalisation, where Arrow's parquet thread pool can abort the process
    # after its work is done ("terminate called without an active exception", SIGABRT; apache/arrow#34314,
    # seen once in a loaded fresh-clone run). A failed assertion above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_result_files_respect_the_umask(tmp_path: Path, umask: int, monkeypatch) -> None:
    from relibra import atomic
    from relibra.trace.format import save_trace
    from tests.builders import make_trace

    old = os.umask(umask)
    atomic._umask.cache_clear()
    try:
        store = ResultsStore(tmp_path)
        k = _put(store, "k", _rows(1), per_layer=_rows(1))
        store.write_grid([k])
        files = [store.cell_path(k), store.per_layer_path(k), store.grid_path]
        files.append(save_trace(make_trace(), tmp_path / "t.npz"))
        for path in files:
            assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path
    finally:
        os.umask(old)
        atomic._umask.cache_clear()


def test_stale_temporaries_are_cleaned_when_a_cell_runs(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    store.cells_dir.mkdir(parents=True)
    old, fresh = store.cells_dir / ".tmp-crashed.parquet", store.cells_dir / ".tmp-writing.parquet"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    run_cell(store, CONFIG, lambda: (_rows(1), None))
    assert not old.exists() and fresh.exists()  # a write in progress elsewhere is left alone


def test_check_writable_names_a_results_dir_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(PermissionError, match=r"results_dir=.*file/store: cannot write"):
        ResultsStore(tmp_path / "file" / "store").check_writable()


def test_a_claim_dies_with_its_holder(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    holding = tmp_path / "holding"
    holder = ctx.Process(target=_hold_claim, args=(str(tmp_path), str(holding)))
    holder.start()
    deadline = time.time() + 60
    while not holding.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert holding.exists()
    os.kill(holder.pid, 9)  # as the OOM killer or `kill -9` would: no clean-up runs
    holder.join(timeout=30)
    start = time.time()
    rows, reused = run_cell(ResultsStore(tmp_path), CONFIG, lambda: (_rows(7), None))
    assert not reused and time.time() - start < 10 and rows["tag"].iloc[0] == 7


@pytest.mark.parametrize("at", ["flock", "stat"])
def test_ctrl_c_while_taking_a_claim_leaves_no_lock_file(tmp_path: Path, monkeypatch, at: str) -> None:
    """Ctrl-C between the lock file's creation and the claim's ``try`` (the window a real SIGINT hit in a
    fresh-clone run of test_faults' Ctrl-C test): the exception passes and no lock file is left."""
    import experiments.store.results_store as store_module

    real = {"flock": store_module.fcntl.flock, "stat": store_module.os.stat}

    def interrupt(*args, **kwargs):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(store_module.fcntl if at == "flock" else store_module.os, at, real[at])
        raise KeyboardInterrupt

    monkeypatch.setattr(store_module.fcntl if at == "flock" else store_module.os, at, interrupt)
    store = ResultsStore(tmp_path)
    with pytest.raises(KeyboardInterrupt), store.claim("k"):
        raise AssertionError("not reached: the claim was interrupted")
    assert not list((tmp_path / "claims").glob("*.lock"))


def test_ctrl_c_while_waiting_leaves_the_holders_lock_file(tmp_path: Path, monkeypatch) -> None:
    """A waiter interrupted while another writer holds the claim leaves that writer's file in place."""
    import experiments.store.results_store as store_module

    ctx = mp.get_context("spawn")
    holding = tmp_path / "holding"
    holder = ctx.Process(target=_hold_claim, args=(str(tmp_path), str(holding)))
    holder.start()
    try:
        deadline = time.time() + 60
        while not holding.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert holding.exists()
        real = store_module.fcntl.flock

        def interrupt(handle, op):  # type: ignore[no-untyped-def]
            if op == store_module.fcntl.LOCK_EX:  # the blocking wait: interrupted
                raise KeyboardInterrupt
            return real(handle, op)

        monkeypatch.setattr(store_module.fcntl, "flock", interrupt)
        with pytest.raises(KeyboardInterrupt), ResultsStore(tmp_path).claim(cell_key(CONFIG)):
            raise AssertionError("not reached")
        assert [p.name for p in (tmp_path / "claims").glob("*.lock")] == [f"{cell_key(CONFIG)}.lock"]
    finally:
        os.kill(holder.pid, 9)
        holder.join(timeout=30)


def _hold_claim(root: str, holding: str) -> None:
    with ResultsStore(Path(root)).claim(cell_key(CONFIG)):
        Path(holding).touch()
        time.sleep(600)


# --- verified reads: a cell file is the cell asked for, whole and unchanged ------------------------------


def _two_cells(tmp_path: Path) -> tuple[ResultsStore, str, str]:
    store = ResultsStore(tmp_path)
    a = _put(store, "megatron", _rows(1, n=50), per_layer=_rows(1))
    b = _put(store, "balanced", _rows(2, n=50), per_layer=_rows(2))
    return store, a, b


def test_a_cell_file_copied_over_another_is_named_and_recomputed(tmp_path: Path) -> None:
    store, a, b = _two_cells(tmp_path)
    store.cell_path(a).write_bytes(store.cell_path(b).read_bytes())
    with pytest.raises(CorruptCellError, match=f"holds cell {b}, not {a}"):
        store.read(a)
    assert store.corrupt_keys() == [a]
    _, reused = run_cell(store, _named("megatron")[1], lambda: (_rows(9, n=50), None))
    assert not reused and store.read(a)["tag"].iloc[0] == 9


def test_a_per_layer_file_copied_over_another_is_refused(tmp_path: Path) -> None:
    store, a, b = _two_cells(tmp_path)
    store.per_layer_path(a).write_bytes(store.per_layer_path(b).read_bytes())
    with pytest.raises(CorruptCellError, match="holds cell"):
        store.read_per_layer(a)


def _rewrite_with_metadata(path: Path, frame: pd.DataFrame) -> None:
    """Write ``frame`` over ``path`` keeping the file's schema metadata (key, config, checksum)."""
    meta = pq.read_schema(path).metadata
    table = pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(meta)
    pq.write_table(table, path)


def test_changed_rows_under_the_old_checksum_are_named_and_recomputed(tmp_path: Path) -> None:
    store, a, _ = _two_cells(tmp_path)
    frame = store.read(a)
    frame.loc[3, "step_time_s"] += 1e-9  # what a flipped mantissa bit that still decodes does
    _rewrite_with_metadata(store.cell_path(a), frame)
    with pytest.raises(CorruptCellError, match="do not match their checksum"):
        store.read(a)
    assert store.finished(a) is None and store.load()["cell"].tolist() == [_named("balanced")[0]] * 50


def _column_chunk(path: Path, column: str) -> tuple[int, int]:
    """(first byte, length) of ``column``'s chunk in row group 0 of the parquet file at ``path``."""
    meta = pq.ParquetFile(path).metadata
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    chunk = meta.row_group(0).column(names.index(column))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    return int(start), int(chunk.total_compressed_size)


def test_every_bit_flipped_in_the_step_time_column_is_caught(tmp_path: Path) -> None:
    store, a, _ = _two_cells(tmp_path)
    path = store.cell_path(a)
    original, good = path.read_bytes(), store.read(a)
    start, length = _column_chunk(path, "step_time_s")
    for offset in range(start, start + length):
        damaged = bytearray(original)
        damaged[offset] ^= 0x10
        path.write_bytes(bytes(damaged))
        try:
            rows = store.read(a)
        except CorruptCellError:
            continue
        pd.testing.assert_frame_equal(rows, good)  # a flip that changes nothing decoded (e.g. page stats)
    path.write_bytes(original)
    pd.testing.assert_frame_equal(store.read(a), good)


def test_a_cell_without_checksum_is_recomputed_with_a_message(tmp_path: Path, caplog) -> None:
    store, a, _ = _two_cells(tmp_path)
    meta = dict(pq.read_schema(store.cell_path(a)).metadata)
    del meta[b"relibra.checksum"]  # as the suite wrote cells before checksums
    table = pq.read_table(store.cell_path(a)).replace_schema_metadata(meta)
    pq.write_table(table, store.cell_path(a))
    with caplog.at_level("WARNING", logger="experiments.store"):
        assert store.finished(a) is None
    assert "no content checksum" in caplog.text and str(store.cell_path(a)) in caplog.text


def test_a_stored_config_that_does_not_hash_to_the_key_is_refused(tmp_path: Path) -> None:
    store, a, _ = _two_cells(tmp_path)
    meta = dict(pq.read_schema(store.cell_path(a)).metadata)
    meta[b"relibra.config"] = b'{"seed": "someone else"}'
    pq.write_table(pq.read_table(store.cell_path(a)).replace_schema_metadata(meta), store.cell_path(a))
    with pytest.raises(CorruptCellError, match="does not hash to its key"):
        store.read(a)


def test_a_directory_at_a_cell_path_is_a_corrupt_cell_and_is_replaced(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    key, config = _named("dir")
    store.cell_path(key).mkdir(parents=True)
    store.per_layer_path(key).mkdir(parents=True)
    with pytest.raises(CorruptCellError, match="a directory"):
        store.read(key)
    assert store.corrupt_keys() == [key] and store.load().empty
    rows, reused = run_cell(store, config, lambda: (_rows(4), _rows(4)))
    assert not reused and store.cell_path(key).is_file()
    pd.testing.assert_frame_equal(store.read(key), rows)
    pd.testing.assert_frame_equal(store.read_per_layer(key), _rows(4))


def test_a_store_refuses_a_key_that_is_not_the_configs() -> None:
    with pytest.raises(ValueError, match="hashes to"):
        ResultsStore(Path("/nonexistent")).write("0123456789abcdef", _rows(1), CONFIG)


def test_a_verified_cell_is_still_plain_parquet(tmp_path: Path) -> None:
    store, a, _ = _two_cells(tmp_path)
    pd.testing.assert_frame_equal(pd.read_parquet(store.cell_path(a)), store.read(a))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_cell_is_either_refused_or_read_unchanged(tmp_path: Path, data) -> None:
    store = ResultsStore(tmp_path / str(data.draw(st.integers(0, 10**9))))
    key = _put(store, "fuzz", _rows(5, n=40))
    path = store.cell_path(key)
    original, good = path.read_bytes(), store.read(key)
    damage = data.draw(st.sampled_from(["flip", "truncate", "zero", "swap"]))
    raw = bytearray(original)
    if damage == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
    elif damage == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    elif damage == "zero":
        start = data.draw(st.integers(0, len(raw) - 1))
        raw[start : start + data.draw(st.integers(1, 64))] = b"\0" * len(raw[start : start + 64])
    else:
        other = _put(store, "other", _rows(6, n=40))
        raw = bytearray(store.cell_path(other).read_bytes())
    path.write_bytes(bytes(raw))
    try:
        rows = store.read(key)
    except CorruptCellError as err:
        assert str(path) in str(err)
    else:
        pd.testing.assert_frame_equal(rows, good)


def test_write_grid_replaces_or_extends_and_returns_the_grid_before(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    assert store.grid_keys() is None
    assert store.write_grid(["a", "b"]) == set()
    assert store.write_grid(["c"]) == {"a", "b"} and store.grid_keys() == {"c"}
    assert store.write_grid(["d", "c"], extend=True) == {"c"} and store.grid_keys() == {"c", "d"}
    assert json.loads(store.grid_path.read_text()) == ["c", "d"]  # sorted, each key once
    assert not list((tmp_path / "claims").glob("*.lock"))  # the claim is given back


def test_contents_reads_each_cell_once_for_rows_config_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The rows are `load`'s, the configs `config`'s, one file read per cell; a corrupt cell is left out of
    both (with its warning) and listed, and a key of grid.json without a cell file is listed unfinished."""
    store = ResultsStore(tmp_path)
    keys = [_put(store, name, _rows(i)) for i, name in enumerate(["a", "b", "c"])]
    _truncate(store.cell_path(keys[2]))
    store.write_grid([*keys, "not-run-yet"])
    expected_frame = store.load()
    expected_configs = {k: store.config(k) for k in keys[:2]}

    import experiments.store.results_store as store_module

    reads: list[Path] = []
    real = store_module._read_table
    monkeypatch.setattr(store_module, "_read_table", lambda path: (reads.append(path), real(path))[1])
    with caplog.at_level("WARNING", logger="experiments.store"):
        contents = store.contents()
    pd.testing.assert_frame_equal(contents.rows, expected_frame)
    assert contents.configs == expected_configs and set(contents.configs) == set(contents.rows["cell"])
    assert sorted(reads) == sorted(store.cell_path(k) for k in keys)  # each file once, the corrupt one too
    assert str(store.cell_path(keys[2])) in caplog.text
    assert (contents.corrupt, contents.unfinished) == ([keys[2]], ["not-run-yet"])
    assert store.contents(all_cells=True).unfinished == []  # every cell on disk: no grid to finish


def test_a_file_system_without_locks_is_warned_about_naming_what_it_risks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """flock fails (a file system without locks): the store goes on and says what may happen, for a cell's
    claim and for grid.json's."""
    import experiments.store.results_store as store_module

    def no_locks(handle, op):  # type: ignore[no-untyped-def]
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(store_module.fcntl, "flock", no_locks)
    store = ResultsStore(tmp_path)
    with caplog.at_level("WARNING", logger="experiments.store"):
        store.write_grid(["a"])
        with store.claim("0123456789abcdef"):
            pass
    assert store.grid_keys() == {"a"}
    assert "grid.json may lose a concurrent run's keys" in caplog.text
    assert "cell 0123456789abcdef may be computed twice" in caplog.text


def test_a_lost_per_layer_table_unfinishes_its_cell(tmp_path: Path) -> None:
    """The cell file records its per-layer table: when that file is gone the cell counts as missing (a
    rerun restores both), and a load keeps the rows but names the cell."""
    store = ResultsStore(tmp_path)
    layers = pd.DataFrame({"planner": ["relibra"], "layer": [0], "skew": [1.5]})
    key = _put(store, "a", _rows(1), layers)
    other = _put(store, "b", _rows(2), layers)
    store.per_layer_path(key).unlink()
    assert store.finished(key) is None and store.finished(other) is not None
    with pytest.raises(CorruptCellError, match=rf"per_layer/{key}\.parquet.*missing"):
        store.read(key)
    contents = store.contents()
    assert contents.lost_per_layer == [key] and set(contents.rows["cell"]) == {key, other}
    assert store.per_layer_contents()[1] == []


def test_a_cell_stored_without_a_per_layer_table_drops_an_earlier_one(tmp_path: Path) -> None:
    store = ResultsStore(tmp_path)
    key = _put(store, "a", _rows(1), pd.DataFrame({"planner": ["relibra"], "skew": [9.0]}))
    _put(store, "a", _rows(1))
    assert store.read_per_layer(key) is None and store.finished(key) is not None


def test_a_per_layer_table_of_another_computation_is_refused(tmp_path: Path) -> None:
    """A recompute that stopped after writing the per-layer table, before the cell file: the table is
    whole and of this key, but not the one the cell file records."""
    import experiments.store.cell_files as store_module

    store = ResultsStore(tmp_path)
    key = _put(store, "a", _rows(1), pd.DataFrame({"layer": [0], "skew": [1.5]}))
    newer = pd.DataFrame({"layer": [0], "skew": [3.0]})
    meta = {
        store_module._KEY_META: key.encode(),
        store_module._CHECKSUM_META: store_module.content_checksum(newer).encode(),
    }
    store_module.atomic_write_parquet(newer, store.per_layer_path(key), meta)
    with pytest.raises(CorruptCellError, match="not the per-layer table its cell file records"):
        store.read_per_layer(key)
    assert store.per_layer_contents()[1] == [key]
    assert store.finished(key) is None and store.contents().lost_per_layer == [key]  # recomputed on a rerun
