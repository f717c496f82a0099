"""scripts/identical_stores.py: two stores' cells compared exactly on their result columns, wall-clock
columns and the code version left out, on hand-made cells."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("identical_stores", REPO / "scripts" / "identical_stores.py")
assert _spec is not None and _spec.loader is not None
identical_stores = importlib.util.module_from_spec(_spec)
sys.modules["identical_stores"] = identical_stores  # NOTE: its dataclasses look their module up there
_spec.loader.exec_module(identical_stores)


def _cell(
    root: Path,
    planner: str,
    step: float,
    version: str,
    plan_s: float,
    layer_t: float = 0.5,
    attention: tuple[str, float] | None = None,
) -> str:
    config = {"planner": {"name": planner}, "seed": 0}
    key = cell_key(config)
    rows = pd.DataFrame(
        {
            "planner": [planner],
            "step_time_s": [step],
            "skew_mean": [float("nan")],
            "plan_time_s": [plan_s],
            "cp_wait_s": [plan_s / 2],
            "portfolio_keep_plan_s": [plan_s / 3],
            "llep_measured_plan_s_per_layer": [plan_s / 4],
            "code_version": [version],
        }
    )
    per_layer = pd.DataFrame({"layer": [0, 1], "t_moe_s": [layer_t, 0.25], "plan_time_s": [plan_s, plan_s]})
    if attention is not None:
        per_layer[attention[0]] = [attention[1], 0.125]
    ResultsStore(root / "overall").write(key, rows, config, per_layer)
    return key


def test_identical_cells_pass_whatever_their_wall_clock_and_code_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for planner, step in (("a", 1.25), ("b", 2.5)):
        _cell(tmp_path / "old", planner, step, "0.1.0+gold", plan_s=3.0)
        _cell(tmp_path / "new", planner, step, "0.1.0+gnew", plan_s=0.5)  # NaN skew equal to NaN
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "overall: 2 cells compared, 0 differ" in out
    assert "old ['0.1.0+gold'], new ['0.1.0+gnew']" in out


def test_a_last_bit_difference_in_a_result_fails_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cell(tmp_path / "old", "a", 1.25, "v", plan_s=1.0)
    key = _cell(tmp_path / "new", "a", 1.25 + 2.0**-50, "v", plan_s=1.0)
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert f"{key} (a): step_time_s" in out and "1 differ" in out


def test_a_difference_in_the_per_layer_table_alone_fails_and_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _cell(tmp_path / "old", "a", 1.25, "v", plan_s=1.0)
    _cell(tmp_path / "new", "a", 1.25, "v", plan_s=2.0, layer_t=0.5 + 2.0**-40)
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 1
    out = capsys.readouterr().out
    assert "(a): per_layer.t_moe_s" in out and "per_layer.plan_time_s" not in out


def test_no_shared_cell_is_not_evidence(tmp_path: Path) -> None:
    _cell(tmp_path / "old", "a", 1.0, "v", plan_s=1.0)
    _cell(tmp_path / "new", "b", 1.0, "v", plan_s=1.0)
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 1


def test_a_root_that_is_no_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _cell(tmp_path / "old", "a", 1.0, "v", plan_s=1.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        identical_stores.main([str(tmp_path / "old"), str(tmp_path / "empty")])
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'empty'}: not a results store" in capsys.readouterr().err


def test_the_trace_path_is_not_compared_and_an_unreadable_cell_differs_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two roots hold the same trace at two paths (a moved store): equal cells; a cell whose per-layer
    table is lost on one side is named, not a traceback."""
    for side in ("old", "new"):
        key = _cell(tmp_path / side, "a", 1.0, "v", plan_s=1.0)
        store = ResultsStore(tmp_path / side / "overall")
        store.write(key, store.read(key).assign(trace=f"/{side}/traces/t.npz"), store.config(key),
                    store.read_per_layer(key))  # fmt: skip
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    ResultsStore(tmp_path / "new" / "overall").per_layer_path(key).unlink()
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 1
    assert f"{key} (?): <unreadable:" in capsys.readouterr().out


@pytest.mark.parametrize(("new_value", "rc"), [(0.75, 0), (0.75 + 2.0**-40, 1)])
def test_a_renamed_per_layer_column_is_compared_under_its_new_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], new_value: float, rc: int
) -> None:
    _cell(tmp_path / "old", "a", 1.25, "v", plan_s=1.0, attention=("t_attention_s", 0.75))
    _cell(tmp_path / "new", "a", 1.25, "v", plan_s=1.0, attention=("t_layer_attention_s", new_value))
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == rc
    out = capsys.readouterr().out
    assert "per_layer.t_attention_s of the old store compared as per_layer.t_layer_attention_s" in out
    assert ("per_layer.t_layer_attention_s" in out.split("(renamed)")[1]) == bool(rc), out


def test_cells_stored_under_an_earlier_key_rule_are_compared_by_their_current_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An old store's peer cell was keyed with its trace folder (``peer.dir``, since left out of the key):
    it is compared with the new store's cell of the same config under the current key."""
    import json

    import experiments.store.cell_files as cell_files
    from experiments.store.keys import _BEFORE_PEER_DIR

    rows = pd.DataFrame({"planner": ["a"], "step_time_s": [1.5], "code_version": ["v"]})
    old = {"planner": {"name": "a"}, "seed": 0, "peer": {"workload": "W0", "dir": "/x/traces"}}
    key = cell_key(old, _BEFORE_PEER_DIR)  # NOTE: written as the suite wrote it then (write() refuses it now)
    meta = {
        cell_files._KEY_META: key.encode(),
        cell_files._CONFIG_META: json.dumps(old, sort_keys=True).encode(),
        cell_files._CHECKSUM_META: cell_files.content_checksum(rows).encode(),
    }
    cell_files.atomic_write_parquet(rows, ResultsStore(tmp_path / "old" / "peer").cell_path(key), meta)
    new = {**old, "peer": {"workload": "W0", "dir": "/y/traces"}}
    ResultsStore(tmp_path / "new" / "peer").write(cell_key(new), rows, new)
    assert identical_stores.main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
    assert "peer: 1 cells compared, 0 differ" in capsys.readouterr().out
