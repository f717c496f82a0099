"""The torch executor's wall-time estimate (relibra.executors.budget) and its refusal at preflight."""

from __future__ import annotations

import numpy as np
import pytest

from relibra.executors import budget


def test_workload_flops_hand_counted() -> None:
    # 1 micro-batch, 1 layer, 2 ranks, 2 experts, top_k 1; expert e at home on rank e.
    load = np.array([[[[3, 1], [0, 2]]]])  # [M, L, G, E]: rank 0 holds 4 tokens, rank 1 holds 2
    home = np.array([[0, 1]])
    h, f = 4, 2
    # rank 0: 4 source tokens, expert 0 gets 3 rows; rank 1: 2 source tokens, expert 1 gets 1 + 2 = 3 rows
    rank0 = 6 * 4 * h * (h + 2) + 24 * 3 * h * f  # 576 + 576
    rank1 = 6 * 2 * h * (h + 2) + 24 * 3 * h * f  # 288 + 576
    got = budget.workload_flops(load, home, top_k=1, hidden=h, ffn=f, warmup=False)
    assert got.tolist() == [[max(rank0, rank1)]] == [[1152.0]]
    warm = budget.workload_flops(load, home, top_k=1, hidden=h, ffn=f, warmup=True)
    assert warm.tolist() == [[1152.0], [1152.0]]  # the first micro-batch runs twice


def test_estimate_time_scales_with_ranks_per_core() -> None:
    flops = np.full((2, 3), 1e9)
    one_core_each = budget.estimate_time_s(flops, rate=1e9, world=4, cores=4, start_method="fork")
    assert one_core_each == pytest.approx(6.0 + budget.PROCESS_START_S["fork"])
    shared = budget.estimate_time_s(flops, rate=1e9, world=4, cores=2, start_method="fork")
    assert shared == pytest.approx(2 * one_core_each)


def test_matmul_rate_is_measured_and_cached() -> None:
    pytest.importorskip("torch")
    rate = budget.matmul_rate(16, 8)
    assert rate > 0 and budget.matmul_rate(16, 8) == rate
