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
    # 6 cells of 1 s compute + 0.5 s overhead each, plus 2 s to start a rank
    one_core_each = budget.estimate_time_s(flops, rate=1e9, overhead_s=0.5, world=4, cores=4, start_s=2.0)
    assert one_core_each == pytest.approx(6 * 1.5 + 2.0)
    shared = budget.estimate_time_s(flops, rate=1e9, overhead_s=0.5, world=4, cores=2, start_s=2.0)
    assert shared == pytest.approx(2 * one_core_each)


def test_cell_overhead_is_what_the_flops_do_not_explain() -> None:
    assert budget.cell_overhead_s(cell_s=0.03, cell_flops=1e7, rate=1e9) == pytest.approx(0.02)
    assert budget.cell_overhead_s(cell_s=0.001, cell_flops=1e7, rate=1e9) == 0.0  # never negative


def test_probe_tokens_keep_the_run_shape_until_the_cap() -> None:
    from relibra.executors import time_probe

    assert time_probe.probe_tokens(64, experts=16, top_k=8, hidden=64, ffn=32) == 64
    assert time_probe.probe_tokens(60, experts=16, top_k=8, hidden=64, ffn=32) == 64  # a multiple of 16
    big = time_probe.probe_tokens(4096, experts=16, top_k=8, hidden=512, ffn=256)
    cell = budget.layer_flops(np.array(big), np.array(big * 8), 512, 256, 16)
    assert 16 <= big < 4096 and big % 16 == 0
    assert cell <= time_probe.PROBE_MAX_FLOPS or big == 16


def test_cell_cost_times_the_worker_code_in_process() -> None:
    pytest.importorskip("torch")
    import torch.distributed as dist

    from relibra.executors import time_probe

    cost = time_probe.cell_cost(4, 16, 2, 16, 8)
    assert cost.seconds > 0 and cost.init_s > 0 and cost.first_s > 0 and not dist.is_initialized()
    assert cost.flops == budget.layer_flops(np.array(16), np.array(32), 16, 8, 4)
    assert time_probe.cell_cost(4, 16, 2, 16, 8) is cost  # cached per process


def test_matmul_rate_is_measured_and_cached() -> None:
    pytest.importorskip("torch")
    rate = budget.matmul_rate(16, 8)
    assert rate > 0 and budget.matmul_rate(16, 8) == rate


@pytest.mark.slow
def test_estimate_is_within_3x_of_a_real_run(monkeypatch) -> None:
    """One small real run (olmoe shape, 4 ranks, 8 samples of at most 64 tokens, the default 64 x 32
    experts): the preflight estimate against the wall time of ``TorchExecutor.execute`` (start, every
    micro-batch and layer, the Adam step). Factor 3: the estimate leaves out the gloo all-to-all waits and
    measures on a host whose load changes between the probe and the run (docs/records/runtime.md, "Torch
    executor time estimate")."""
    pytest.importorskip("torch")
    import time

    from experiments.run import compute
    from relibra.executors import torch_executor
    from tests.builders import cfg

    estimates: list[float] = []
    real_estimate = budget.estimate_time_s
    monkeypatch.setattr(
        budget, "estimate_time_s", lambda *a: estimates.append(real_estimate(*a)) or estimates[-1]
    )
    walls: list[float] = []
    real_execute = torch_executor.TorchExecutor.execute

    def timed(self, *a):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        out = real_execute(self, *a)
        walls.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(torch_executor.TorchExecutor, "execute", timed)
    tiny = ["model=olmoe-1b-7b", "trace.num_batches=1", "trace.samples_per_batch=8", "trace.max_tokens=64",
            "cluster.nodes=1", "cluster.gpus_per_node=4", "executor=torch", "logger=none"]  # fmt: skip
    from experiments.config.checks import check_config

    compute(check_config(cfg(*tiny)))
    assert len(estimates) == 1 and len(walls) == 1
    ratio = estimates[0] / walls[0]
    assert 1 / 3 <= ratio <= 3, f"estimate {estimates[0]:.1f} s, measured {walls[0]:.1f} s"
