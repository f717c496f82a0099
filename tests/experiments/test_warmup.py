"""experiments.grid.warmup: every numba kernel's step compiled once, in spawned processes beside the body."""

from __future__ import annotations

import time

import pytest

from baselines.warmup import STEPS as BASELINES
from experiments.grid import warmup
from experiments.grid.warmup import STEPS, WarmupError, groups, warming


@pytest.mark.parametrize("processes", [1, 2, 3, 4, 6, 10])
def test_groups_hold_every_step_once(processes: int) -> None:
    split = groups(processes)
    assert sorted(step for group in split for step in group) == sorted(STEPS)
    assert len(split) == min(max(processes, 1), len(STEPS))
    if processes > 1:
        assert split[0] == ("relibra",)  # NOTE: the longest step alone


def test_every_compiled_baseline_is_a_step() -> None:
    """ForeMoE's and MoonEP's kernels included (they once compiled inside each worker's first cell)."""
    assert set(BASELINES) == {"ultraep", "llep", "foremoe", "moonep", "echo"}
    assert STEPS == ("relibra", *BASELINES)


def test_one_worker_warms_nothing() -> None:
    with warming(1):
        pass


def test_a_step_that_fails_is_raised_when_the_body_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "groups", lambda n: [("no_such_step",)] * n)
    with pytest.raises(WarmupError, match="no_such_step"), warming(2):
        pass


def test_a_body_that_raises_stops_the_warm_up_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    start = time.perf_counter()
    with pytest.raises(KeyError), warming(2):
        raise KeyError("planning failed")
    assert time.perf_counter() - start < 30  # NOTE: not the whole compilation of a cold cache
