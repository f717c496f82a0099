"""The transfer schedule of each kind of method, priced by the one function, against numbers worked by hand
(relibra.cost.transfers).

Cluster: 2 nodes x 2 GPUs. GPUs: 0 = (node 0, rail 0), 1 = (node 0, rail 1), 2 = (node 1, rail 0),
3 = (node 1, rail 1). NVLink 100 GB/s, NIC 10 GB/s and host link 64 GB/s effective. One MoE layer of four
experts, expert ``e`` at home on GPU ``e``; an expert is 24 parameters, so a bf16 copy is ``W = 48`` bytes
and a migration payload (bf16 weight, fp32 master, two fp32 moments) 24 x 14 = 336 bytes. One micro-batch
whose layer attention (fwd + bwd) is ``A = 7.2e-10`` s: the forward fill may hide behind ``A / 3 = 2.4e-10``
s, the gradient return behind ``2 A / 3 = 4.8e-10`` s.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from relibra.cluster import ClusterSpec
from relibra.cost.migration import MigrationPayload, migration_cost
from relibra.cost.model import CostModel
from relibra.cost.pricing import redundant_sync_time
from relibra.cost.transfers import TRANSFER_KINDS, Transfer, plan_transfers, price_transfers, refill_exposed
from relibra.types import BatchPlan, OnlineCopies
from tests.builders import ROUND_MODEL, ROUND_NIC, ROUND_NVL, ROUND_RATES_HW

HW = replace(ROUND_RATES_HW, host_to_device_bytes_per_s=64e9)
MODEL = ROUND_MODEL
W = 48.0
NVL, NIC, HOST = ROUND_NVL, ROUND_NIC, 64e9
A = np.array([[7.2e-10]])
"""float64 [Mb=1, 1]: one layer's attention seconds (fwd + bwd)."""
HOME = np.array([[0, 1, 2, 3]], dtype=np.int32)


def _cost(window_s: float = 0.0) -> CostModel:
    return CostModel(
        ClusterSpec(nodes=2, gpus_per_node=2, hardware=HW),
        MODEL,
        migration=MigrationPayload(window_s=window_s),
    )


def _plan(replicas: np.ndarray | None = None, home: np.ndarray = HOME, **kw) -> BatchPlan:
    """A plan of one micro-batch computing every expert at home (the slots are what is priced here)."""
    assign = np.zeros((1, 1, 4, 4), dtype=np.int32)
    assign[0, 0, np.arange(4), home[0]] = 1
    load = np.zeros((1, 1, 4, 4), dtype=np.int32)
    load[0, 0, np.arange(4), np.arange(4)] = 1
    return BatchPlan(home=home, assign=assign, load=load, sample_gpu=np.arange(4, dtype=np.int32),
                     replicas=replicas, **kw)  # fmt: skip


def _slots(gpu: int, expert: int) -> np.ndarray:
    """int32 [1, 1, 4, 1]: one replica slot per GPU, ``gpu``'s holding ``expert``."""
    reps = np.full((1, 1, 4, 1), -1, dtype=np.int32)
    reps[0, 0, gpu, 0] = expert
    return reps


def test_relibra_refill_hides_behind_attention():
    # expert 0 copied to GPU 1 in its node: W / NVL = 4.8e-10 s each way. Forward: 4.8e-10 - 2.4e-10 exposed;
    # backward: fully hidden behind 4.8e-10.
    cost = _cost()
    schedule = plan_transfers(_plan(_slots(1, 0)), cost, HOME)
    assert [(t.kind, t.path, t.overlap) for t in schedule.transfers] == [
        ("replica_fill", "nvlink", "forward_attention"),
        ("gradient_return", "nvlink", "backward_attention"),
        ("migration", "migration", "post_rollout"),
    ]
    assert schedule.buffer_slots == 1 and schedule.moved == 0
    charge = price_transfers(schedule, cost, A)
    np.testing.assert_allclose(charge.layer_exposed, [[2.4e-10]], rtol=1e-12)
    np.testing.assert_allclose(charge.recompute_exposed, [[2.4e-10]], rtol=1e-12)
    assert charge.exposed["replica_fill"] == pytest.approx(2.4e-10, rel=1e-12)
    assert charge.hidden["replica_fill"] == pytest.approx(2.4e-10, rel=1e-12)
    assert charge.exposed["gradient_return"] == 0.0
    assert charge.hidden["gradient_return"] == pytest.approx(4.8e-10, rel=1e-12)
    fill = cost.replica_refill_time(_slots(1, 0), HOME)
    np.testing.assert_array_equal(charge.layer_exposed, cost.exposed_refill(fill, A))  # as before


def test_ultraep_online_copies_sit_on_the_critical_path():
    # expert 0 copied to GPU 2 (other node, same rail): W / NIC = 4.8e-9 s on the fabric; two full copies
    # after routing plus the gradient reduction's excess over 2 A / 3: 9.6e-9 + 4.32e-9.
    cost = _cost()
    online = OnlineCopies(critical_path_s=np.zeros((1, 1)), exposed_copies=2, overlapped_gradient_reduce=True)
    schedule = plan_transfers(_plan(_slots(2, 0), online=online), cost, HOME)
    assert [(t.kind, t.path, t.overlap, t.copies) for t in schedule.transfers[:2]] == [
        ("online_copy", "fabric", "none", 2),
        ("gradient_return", "fabric", "backward_attention", 1),
    ]
    charge = price_transfers(schedule, cost, A)
    np.testing.assert_allclose(charge.layer_exposed, [[1.392e-8]], rtol=1e-12)
    np.testing.assert_allclose(charge.recompute_exposed, [[4.8e-9]], rtol=1e-12)
    fill = cost.fabric_copy_time(_slots(2, 0), HOME)
    np.testing.assert_array_equal(
        charge.layer_exposed, 2 * fill + np.maximum(fill - 2 * A / 3, 0)
    )  # as before


def test_online_copies_without_a_gradient_reduction_are_charged_exposed_copies_times():
    cost = _cost()
    online = OnlineCopies(
        critical_path_s=np.zeros((1, 1)), exposed_copies=3, overlapped_gradient_reduce=False
    )
    charge = price_transfers(plan_transfers(_plan(_slots(2, 0), online=online), cost, HOME), cost, A)
    np.testing.assert_allclose(charge.layer_exposed, [[3 * 4.8e-9]], rtol=1e-12)
    assert "gradient_return" not in charge.exposed


def test_foremoe_host_path_fills_from_the_host_and_returns_gradients_on_the_fabric():
    # expert 0 to GPU 2: the host link (64 GB/s) beats the NIC (10 GB/s), so the fill is W / HOST = 7.5e-10
    # (5.1e-10 exposed); the gradients return over the NIC, 4.8e-9 (4.32e-9 exposed).
    cost = _cost()
    schedule = plan_transfers(_plan(_slots(2, 0), host_path=True), cost, HOME)
    assert [(t.kind, t.path) for t in schedule.transfers[:2]] == [
        ("replica_fill", "host_engine"),
        ("gradient_return", "fabric"),
    ]
    charge = price_transfers(schedule, cost, A)
    np.testing.assert_allclose(charge.layer_exposed, [[5.1e-10 + 4.32e-9]], rtol=1e-12)
    np.testing.assert_allclose(charge.recompute_exposed, [[5.1e-10]], rtol=1e-12)
    fill, back = cost.engine_copy_time(_slots(2, 0), HOME), cost.fabric_copy_time(_slots(2, 0), HOME)
    np.testing.assert_array_equal(charge.layer_exposed, cost.exposed_copies(fill, back, A))  # as before


def test_eplb_redundant_sync_is_two_exposed_transfers_per_step():
    # a permanent copy of expert 0 on GPU 2: its gradients to GPU 0 and the weights back, W / NIC each.
    cost = _cost()
    redundant = np.full((1, 4, 1), -1, dtype=np.int32)
    redundant[0, 2, 0] = 0
    plan = _plan(redundant=redundant)
    schedule = plan_transfers(plan, cost, HOME)
    (sync,) = schedule.of("redundant_sync")
    assert (sync.path, sync.overlap, sync.copies) == ("network", "none", 2)
    assert sync.src is not None and sync.dst is not None
    assert sync.src.tolist() == [2] and sync.dst.tolist() == [0]
    charge = price_transfers(schedule, cost, A)
    assert charge.step_exposed("redundant_sync") == pytest.approx(2 * W / NIC, rel=1e-12)
    assert charge.hidden["redundant_sync"] == 0.0
    assert charge.step_exposed("redundant_sync") == redundant_sync_time(plan, cost)
    np.testing.assert_array_equal(charge.layer_exposed, np.zeros((1, 1)))


def test_migration_beyond_the_post_rollout_window_is_exposed():
    # experts 0 and 2 swap GPUs 0 and 2 (other node, same rail): each NIC sends and receives 336 bytes,
    # 3.36e-8 s; a 1e-8 s window hides that much of it.
    cost = _cost(window_s=1e-8)
    home = np.array([[2, 1, 0, 3]], dtype=np.int32)
    schedule = plan_transfers(_plan(home=home), cost, HOME)
    assert schedule.moved == 2 and schedule.transfers[-1].bytes_each == pytest.approx(336.0)
    charge = price_transfers(schedule, cost, A)
    assert charge.step_exposed("migration") == pytest.approx(2.36e-8, rel=1e-9)
    assert charge.hidden["migration"] == pytest.approx(1e-8, rel=1e-9)
    assert charge.network_bytes["migration"] == 672.0
    before = migration_cost(cost, HOME, home)
    assert (charge.step_exposed("migration"), charge.hidden["migration"]) == (
        before.exposed_s,
        before.seconds - before.exposed_s,
    )


def test_a_schedule_without_transfers_costs_nothing():
    cost = _cost()
    charge = price_transfers(plan_transfers(_plan(), cost, HOME), cost, A)
    np.testing.assert_array_equal(charge.layer_exposed, np.zeros((1, 1)))
    assert charge.step_exposed("migration") == 0.0 and charge.step_exposed("redundant_sync") == 0.0


def test_a_transfer_names_its_ends():
    assert set(TRANSFER_KINDS) == {
        "replica_fill",
        "gradient_return",
        "online_copy",
        "migration",
        "redundant_sync",
    }
    with pytest.raises(ValueError, match="slots and home"):
        Transfer("replica_fill", "nvlink", "forward_attention", W)
    with pytest.raises(ValueError, match="src and dst"):
        Transfer("migration", "migration", "post_rollout", W)


def test_a_planners_refill_price_is_the_schedules():
    """Planners price one micro-batch's slots [L, G, r] by the same function: bit-equal to the closed form
    ``max(0, fill - A / 3) + max(0, fill - 2 A / 3)`` for any slot contents."""
    cost = _cost()
    rng = np.random.default_rng(0)
    home = np.tile(HOME, (3, 1))  # three layers
    slots = rng.integers(-1, 4, size=(3, 4, 2)).astype(np.int32)
    window = 5e-10
    fill = cost.replica_refill_time(slots, home)
    np.testing.assert_array_equal(
        refill_exposed(cost, slots, home, window), cost.exposed_refill(fill, window)
    )
    assert refill_exposed(cost, slots, home, window).shape == (3,)
