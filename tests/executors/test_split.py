"""The integer split rule (``relibra.executors.split``): exact margins, floor-or-ceiling entries, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.executors.split import split_counts
from relibra.invariants import PlanInvariantError


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """load [J, E] and an assign [E, G] that splits every expert's total over G copies (some empty)."""
    num_src = draw(st.integers(1, 6))
    num_copies = draw(st.integers(1, 6))
    num_experts = draw(st.integers(1, 3))
    load = np.array(
        draw(st.lists(st.integers(0, 60), min_size=num_src * num_experts, max_size=num_src * num_experts)),
        dtype=np.int64,
    ).reshape(num_src, num_experts)
    assign = np.zeros((num_experts, num_copies), dtype=np.int64)
    for e in range(num_experts):
        total = int(load[:, e].sum())
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=num_copies - 1, max_size=num_copies - 1)))
        assign[e] = np.diff([0, *cuts, total])
    return load, assign


@settings(max_examples=300, deadline=None)
@given(case=split_cases())
def test_margins_exact_and_entries_floor_or_ceiling(case: tuple[np.ndarray, np.ndarray]) -> None:
    load, assign = case
    n = split_counts(load, assign)  # [J, E, G]
    assert n.dtype == np.int64 and n.shape == (load.shape[0], load.shape[1], assign.shape[1])
    assert (n >= 0).all()
    np.testing.assert_array_equal(n.sum(axis=2), load)
    np.testing.assert_array_equal(n.sum(axis=0), assign)
    # floor(p) <= n <= ceil(p) with p = x * a / A, checked in integers: n * A - x * a in (-A, A)
    total = assign.sum(axis=1)[None, :, None]
    scaled = n * total - load[:, :, None] * assign[None]
    assert (np.abs(scaled) < np.maximum(total, 1)).all()
    # an integer share is met exactly (in particular no token for an empty source or copy)
    exact = (load[:, :, None] * assign[None]) % np.maximum(total, 1) == 0
    assert (scaled[exact] == 0).all()
    np.testing.assert_array_equal(split_counts(load, assign), n)  # deterministic


def per_source_rounding(x: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-2 of the rule written out for one expert (each source's largest remainders, ties to the
    lower GPU): x [J], a [G] -> the rounding [J, G] (row sums exact) and the remainders [J, G]."""
    total = int(a.sum())
    num = x[:, None] * a[None]
    n, rem = num // total, num % total
    for j in range(x.size):
        for g in sorted(range(a.size), key=lambda g: (-rem[j, g], g))[: int(x[j] - n[j].sum())]:
            n[j, g] += 1
    return n, rem


def test_column_fix_up_golden() -> None:
    """Three sources of one token each, three copies of one token each: each source's largest remainder
    (ties to the lower GPU) sends all three to copy 0; the fix-up moves two of them along the shortest
    alternating paths, lowest ids first."""
    x, a = np.array([1, 1, 1]), np.array([1, 1, 1])
    assert per_source_rounding(x, a)[0].sum(axis=0).tolist() == [3, 0, 0]
    n = split_counts(x[:, None], a[None])
    assert n[:, 0].tolist() == [[0, 1, 0], [0, 0, 1], [1, 0, 0]]


def test_fix_up_through_a_third_copy() -> None:
    """After steps 1-2 no source holds an extra token at an over-full copy while it may take one at an
    under-full copy, so the fix-up's path passes through another copy (found by a search over small
    cases); the margins still come out exact and every entry the floor or ceiling of its share."""
    x, a = np.array([4, 2, 4, 2]), np.array([2, 2, 5, 3])
    rounded, rem = per_source_rounding(x, a)
    base = x[:, None] * a[None] // a.sum()
    excess = rounded.sum(axis=0) - a
    over, under = np.flatnonzero(excess > 0), np.flatnonzero(excess < 0)
    assert over.size and under.size
    extra = rounded - base
    assert not any(
        extra[j, g] == 1 and extra[j, h] == 0 and rem[j, h] > 0
        for j in range(x.size)
        for g in over
        for h in under
    )
    n = split_counts(x[:, None], a[None])[:, 0]
    assert n.tolist() == [[0, 1, 2, 1], [1, 0, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]]
    np.testing.assert_array_equal(n.sum(axis=1), x)
    np.testing.assert_array_equal(n.sum(axis=0), a)
    p = x[:, None] * a[None] / a.sum()
    assert (np.floor(p) <= n).all() and (n <= np.ceil(p)).all()


def test_one_source_is_largest_remainder() -> None:
    """With one source the columns are exact after step 2: the largest-remainder rounding itself."""
    assert split_counts(np.array([[5]]), np.array([[1, 2, 2]])).tolist() == [[[1, 2, 2]]]
    assert split_counts(np.array([[4]]), np.array([[2, 1, 1]])).tolist() == [[[2, 1, 1]]]
    assert split_counts(np.array([[3]]), np.array([[0, 1, 2]])).tolist() == [[[0, 1, 2]]]


def test_many_sources_and_copies() -> None:
    """An EP-64-sized layer: 64 sources, 64 GPUs, 32 experts with several copies each."""
    rng = np.random.default_rng(0)
    load = rng.integers(0, 200, (64, 32))
    assign = np.zeros((32, 64), dtype=np.int64)
    for e in range(32):
        copies = rng.choice(64, 4, replace=False)
        assign[e, copies] = rng.multinomial(int(load[:, e].sum()), [0.4, 0.3, 0.2, 0.1])
    n = split_counts(load, assign)
    np.testing.assert_array_equal(n.sum(axis=2), load)
    np.testing.assert_array_equal(n.sum(axis=0), assign)
    p = load[:, :, None] * assign[None] / assign.sum(axis=1)[None, :, None]
    assert (np.abs(n - p) < 1).all()


@pytest.mark.parametrize(
    ("load", "assign", "match"),
    [
        (
            np.array([[3]]),
            np.array([[1, 1]]),
            r"\[token conservation\] assign\[0, :\] sums to 2 tokens but load\[:, 0\] holds 3",
        ),
        (np.array([[2]]), np.array([[0.5, 1.5]]), r"assign\[0, 0\] = 0\.5 is not a whole number"),
        (np.array([[2]]), np.array([[3, -1]]), r"assign\[0, 1\] = -1 is negative"),
        (np.array([[-1]]), np.array([[-1]]), r"load\[0, 0\] = -1 is negative"),
        (np.array([[2, 1]]), np.array([[2, 0]]), r"load has shape \(1, 2\) and assign \(1, 2\)"),
        (np.array([[True]]), np.array([[1]]), r"load has dtype bool"),
    ],
)
def test_refuses_a_split_it_cannot_make(load: np.ndarray, assign: np.ndarray, match: str) -> None:
    with pytest.raises(PlanInvariantError, match=match):
        split_counts(load, assign)


def test_integral_floats_are_accepted() -> None:
    n = split_counts(np.array([[2.0], [1.0]]), np.array([[1.0, 2.0]]))
    np.testing.assert_array_equal(n.sum(axis=0), [[1, 2]])
