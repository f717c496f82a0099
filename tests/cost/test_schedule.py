"""Megatron's (interleaved) 1F1B schedule run op by op (relibra/cost/schedule.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.cost.pipeline import bubble_fraction
from relibra.cost.schedule import rank_order, simulate_schedule


@pytest.mark.parametrize(("pp", "vpp", "mb"), [(2, 1, 4), (4, 1, 8), (4, 2, 8), (8, 4, 32), (4, 3, 12)])
def test_equal_micro_batches_reproduce_the_bubble_formula(pp: int, vpp: int, mb: int) -> None:
    f = np.full((pp, vpp, mb), 1.0 / vpp)
    b = 2.0 * f
    busy = mb * 3.0
    finish = simulate_schedule(f, b)
    assert finish.max() == pytest.approx(busy * (1 + bubble_fraction(pp, vpp, mb)), rel=1e-12)


def test_every_rank_runs_every_op_once() -> None:
    pp, vpp, mb = 4, 2, 8
    for r in range(pp):
        order = rank_order(r, pp, vpp, mb)
        assert sorted(order) == sorted(
            (d, m, c) for d in (True, False) for m in range(mb) for c in range(vpp)
        )


def test_a_slow_micro_batch_costs_its_extra_work() -> None:
    """One micro-batch twice as slow on one middle stage of 1F1B: the steady state absorbs no more than its
    extra work (3 s), where a bubble factor on the stage's mean would charge 3 * (1 + bubble)."""
    pp, vpp, mb = 4, 1, 8
    f = np.full((pp, vpp, mb), 1.0)
    b = 2.0 * f
    base = simulate_schedule(f, b).max()
    f[1, 0, 3] *= 2.0
    b[1, 0, 3] *= 2.0
    assert simulate_schedule(f, b).max() == pytest.approx(base + 3.0)


@pytest.mark.parametrize(("pp", "vpp", "mb"), [(4, 1, 8), (4, 2, 8), (8, 4, 32)])
def test_slow_micro_batches_that_move_between_stages_stall_the_pipeline(pp: int, vpp: int, mb: int) -> None:
    """Every stage equally busy, but micro-batch m slow on stage m mod pp: the mean-based price (the
    busiest stage's seconds times 1 + bubble) misses the stalls the schedule has."""
    f = np.full((pp, vpp, mb), 1.0 / vpp)
    for r in range(pp):
        f[r, :, r::pp] *= 2.0
    b = 2.0 * f
    busy = (f + b).sum(axis=(1, 2)).max()
    assert simulate_schedule(f, b).max() > busy * (1 + bubble_fraction(pp, vpp, mb)) + 1e-9


@settings(max_examples=30, deadline=None)
@given(
    pp=st.integers(1, 4),
    vpp=st.integers(1, 3),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_the_schedule_is_never_faster_than_the_busiest_rank(
    pp: int, vpp: int, groups: int, seed: int
) -> None:
    if vpp > 1 and pp == 1:
        vpp = 1
    mb = pp * groups
    rng = np.random.default_rng(seed)
    f = rng.uniform(0.5, 2.0, (pp, vpp, mb))
    b = rng.uniform(1.0, 4.0, (pp, vpp, mb))
    finish = simulate_schedule(f, b)
    assert finish.max() >= (f + b).sum(axis=(1, 2)).max() - 1e-9
    # a longer op never shortens the step
    f[rng.integers(pp), rng.integers(vpp), rng.integers(mb)] += 1.0
    assert simulate_schedule(f, b).max() >= finish.max() - 1e-9


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="equal shapes"):
        simulate_schedule(np.ones((2, 1, 4)), np.ones((2, 1, 3)))


def test_forward_only_runs_forwards_alone() -> None:
    pp, vpp, mb = 4, 2, 8
    f = np.full((pp, vpp, mb), 0.5)
    finish = simulate_schedule(f, np.full_like(f, 99.0), forward_only=True)
    busy = mb * 1.0
    assert finish.max() == pytest.approx(busy * (1 + bubble_fraction(pp, vpp, mb)))
    assert all(d for d, _, _ in rank_order(0, pp, vpp, mb, forward_only=True))
