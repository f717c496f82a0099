"""Megatron's combined 1F1B all-to-all overlap (relibra.cost.overlap) against hand-computed schedules."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from relibra.cost.overlap import overlapped_time


def test_two_microbatches_by_hand():
    # compute 3 and 6 s (forward 1 / 2, backward 2 / 4), comm 2 and 4 s (1 / 2 per pass).
    # F0 alone: 1 + 1. Pair (F1, B0): max(F1 comm 2, B0 compute 2) + max(B0 comm 1, F1 compute 2) = 4.
    # B1 alone: 4 + 2. Total 12 of the 15 without overlap: 3 s of communication stay exposed.
    total, exposed = overlapped_time(np.array([[3.0], [6.0]]), np.array([[2.0], [4.0]]))
    assert total == pytest.approx(12.0)
    assert exposed == pytest.approx(3.0)


def test_one_microbatch_is_refused():
    with pytest.raises(ValueError, match=r"cluster\.ep_overlap needs at least 2 micro-batches"):
        overlapped_time(np.ones((1, 4)), np.ones((1, 4)))


@settings(max_examples=50, deadline=None)
@given(
    comp=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
    comm=arrays(np.float64, (4, 3), elements=st.floats(0, 10)),
)
def test_overlap_is_bounded_by_compute_and_by_no_overlap(comp, comm):
    total, exposed = overlapped_time(comp, comm)
    assert comp.sum() - 1e-9 <= total <= comp.sum() + comm.sum() + 1e-9
    assert -1e-9 <= exposed <= comm.sum() + 1e-9
