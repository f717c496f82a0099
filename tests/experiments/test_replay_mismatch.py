"""``replay.mismatch`` at the entry point: its check, its refusal at the CLI, and the results' column."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.spec import build_spec
from experiments.inputs import cell_inputs, replay_mismatch, trained_inputs
from experiments.run import compute
from tests.builders import cfg
from tests.experiments.test_entry_refusals import R, _cli, _one_line


@pytest.mark.parametrize("value", ["1.5", "-0.1", "abc", "null", "true", "nan"])
def test_a_mismatch_outside_0_1_is_refused_naming_the_key(value: str) -> None:
    # NOTE: a non-number (abc, null, true, nan) is refused by the run spec's type, a number by the range
    with pytest.raises(ConfigError, match=r"replay\.mismatch=.*must be a (finite )?number"):
        check_config(cfg(*R, f"replay.mismatch={value}"))


def test_the_cli_refuses_it_with_one_line_and_exit_2(tmp_path) -> None:
    line = _one_line(_cli(*R, "replay.mismatch=2", f"hydra.run.dir={tmp_path / 'run'}"))
    assert "replay.mismatch=2" in line and "[0, 1]" in line
    assert not (tmp_path / "run").exists()


def test_zero_builds_no_trained_routes_and_force_balanced_none_at_all() -> None:
    assert trained_inputs(build_spec(cfg(*R)), 8) is None
    forced = cfg(*R, "planner=force_balanced", "replay.mismatch=0.3")
    assert replay_mismatch(build_spec(forced)) == 0.0 and trained_inputs(build_spec(forced), 8) is None


def test_a_cell_with_a_mismatch_is_priced_on_the_trained_routes() -> None:
    base = (*R, "planner=relibra_replicate_only", "control_plane.enabled=false")
    exact, _, _ = compute(check_config(cfg(*base)))
    off, _, _ = compute(check_config(cfg(*base, "replay.mismatch=0.5")))
    assert exact["replay_mismatch"].item() == 0.0 and off["replay_mismatch"].item() == 0.5
    assert off["skew_mean"].item() != exact["skew_mean"].item()
    trained = trained_inputs(build_spec(cfg(*base, "replay.mismatch=0.5")), 8)
    counts, workload = cell_inputs(build_spec(cfg(*base)), 8)
    assert trained is not None
    np.testing.assert_array_equal(trained.workload.sample_gpu, workload.sample_gpu)
    np.testing.assert_array_equal(trained.counts.counts.sum(-1), counts.counts.sum(-1))
    assert not np.array_equal(trained.counts.counts, counts.counts)
