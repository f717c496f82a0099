"""Every cost term against numbers computed by hand for tiny clusters (2 nodes x 2 GPUs unless noted).

GPUs: 0 = (node 0, rail 0), 1 = (node 0, rail 1), 2 = (node 1, rail 0), 3 = (node 1, rail 1).
Model: hidden 4, expert FFN 2 -> 3 * 4 * 2 = 24 parameters per expert; a token is 4 bf16 = 8 bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from relibra.cluster import ClusterSpec, HardwareSpec
from relibra.cost.calibration import load_calibration
from relibra.cost.model import CostModel
from tests.builders import ROUND_MODEL, ROUND_NIC, ROUND_NVL, ROUND_RATES_HW

HW = ROUND_RATES_HW
NVL = ROUND_NVL
NIC = ROUND_NIC
MODEL = ROUND_MODEL


def cost(nodes: int = 2, gpn: int = 2, hw: HardwareSpec = HW, **kw) -> CostModel:
    return CostModel(ClusterSpec(nodes=nodes, gpus_per_node=gpn, hardware=hw), MODEL, **kw)


def test_expert_time_compute_bound():
    # flops = 2 * 24 * n * 3 = 144 n; efficiency 0.5 * n / (n + 10) -> 144 (n + 10) / 5e11 seconds
    t = cost().expert_time(np.array([0, 10, 90]))
    np.testing.assert_allclose(t, [0.0, 144 * 20 / 5e11, 144 * 100 / 5e11])


def test_expert_time_memory_bound():
    slow_hbm = HardwareSpec(**{**HW.__dict__, "hbm_bytes_per_s": 1e6})
    # weights read 3 times: 3 * 24 params * 2 bytes / 1e6 B/s = 144e-6 s, far above the FLOP time
    np.testing.assert_allclose(cost(hw=slow_hbm).expert_time(np.array([5])), [144e-6])


def test_small_counts_are_less_efficient_per_token():
    c = cost()
    per_token = c.expert_time(np.array([1.0, 1000.0])) / np.array([1.0, 1000.0])
    assert per_token[0] > 5 * per_token[1]


def test_gpu_compute_time_sums_experts_per_gpu():
    c = cost()
    assign = np.zeros((4, 4))
    assign[0, 0], assign[1, 0], assign[2, 3] = 10, 90, 10
    want = [144 * 20 / 5e11 + 144 * 100 / 5e11, 0, 0, 144 * 20 / 5e11]
    np.testing.assert_allclose(c.gpu_compute_time(assign), want)


def test_traffic_proportional_split():
    load = np.zeros((4, 4))
    load[0, 0] = 8  # GPU 0 sends 8 tokens to expert 0
    load[2, 0] = 4  # GPU 2 sends 4 tokens to expert 0
    assign = np.zeros((4, 4))
    assign[0, 0], assign[0, 1] = 9, 3  # expert 0: 3/4 on GPU 0, 1/4 on GPU 1
    t = cost().traffic(load, assign)
    want = np.zeros((4, 4))
    want[0, 0], want[0, 1], want[2, 0], want[2, 1] = 6, 2, 3, 1
    np.testing.assert_allclose(t, want)


def test_link_bytes_classes():
    tb = np.zeros((4, 4))
    tb[0, 1] = 10  # same node: NVLink
    tb[0, 2] = 20  # other node, same rail: NIC of rail 0
    tb[0, 3] = 30  # other node, other rail: NVLink 0 -> 1, then NIC of rail 1
    lb = cost().link_bytes(tb)
    np.testing.assert_allclose(lb["nvlink_send"], [40, 0, 0, 0])
    np.testing.assert_allclose(lb["nvlink_recv"], [0, 40, 0, 0])
    np.testing.assert_allclose(lb["nic_send"], [20, 30, 0, 0])
    np.testing.assert_allclose(lb["nic_recv"], [0, 0, 20, 30])


def test_comm_time_cross_rail_by_hand():
    traffic = np.zeros((4, 4))
    traffic[0, 3] = 100  # 800 bytes
    b = 800.0
    # dispatch 0 -> 3: NVLink 0 -> 1, NIC 1 -> 3; combine 3 -> 0: NVLink 3 -> 2, NIC 2 -> 0
    per_pass = np.array([b / NVL + b / NIC, b / NIC, b / NIC, b / NIC + b / NVL])
    np.testing.assert_allclose(cost().comm_time(traffic), 2 * per_pass + 4e-6)


def test_comm_time_single_gpu_free():
    c = CostModel(ClusterSpec(1, 1, HW), MODEL)
    np.testing.assert_allclose(c.comm_time(np.array([[50.0]])), [0.0])


def test_moe_breakdown_is_max_plus_max():
    c = cost()
    load = np.zeros((4, 4))
    load[0, 3] = 100  # GPU 0's tokens all go to expert 3 (home GPU 3)
    assign = np.zeros((4, 4))
    assign[3, 3] = 100
    br = c.moe(load, assign)
    assert br.t_compute == pytest.approx(144 * 110 / 5e11)
    assert br.t_comm == pytest.approx(2 * (800 / NVL + 800 / NIC) + 4e-6)
    assert br.t_moe == pytest.approx(br.t_compute + br.t_comm)


def test_linear_costs():
    lin = cost().linear()
    assert lin.compute_s_per_token == pytest.approx(144 / 5e11)
    assert lin.compute_s_per_expert == pytest.approx(1440 / 5e11)
    assert lin.nvlink_s_per_token == pytest.approx(4 * 8 / NVL)
    assert lin.rdma_s_per_token == pytest.approx(4 * 8 / NIC)


def test_attention_and_dense_time():
    c = cost()
    # q = 2 * 2 = 4, kv = 2: params 4 * (4 + 4) + 4 * 4 = 48; proj 2 * 48 * 10 = 960 FLOPs
    # causal pairs 55: 4 * 55 * 2 heads * 2 dims = 880 FLOPs; x3 fwd+bwd over 1e12 * 0.5
    np.testing.assert_allclose(c.attention_time(np.array([10]), np.array([55.0])), [3 * 1840 / 5e11])
    # dense FFN 8: 2 * 3 * 4 * 8 * 10 = 1920 FLOPs, x3
    np.testing.assert_allclose(c.dense_ffn_time(np.array([10])), [3 * 1920 / 5e11])


def test_refill_times():
    c = cost(nodes=1, gpn=4)
    w = 24 * 2  # bytes per expert
    assert c.expert_weight_bytes() == w
    np.testing.assert_allclose(c.refill_time(np.array([1, 2, 0, 0])), 2 * w / NVL)
    home = np.array([[0, 1, 2, 3]])
    reps = np.full((1, 4, 1), -1)
    reps[0, 1:, 0] = 0  # expert 0 copied to GPUs 1, 2, 3: its home sends three copies
    np.testing.assert_allclose(c.replica_refill_time(reps, home), [3 * w / NVL])
    reps[0, 2:, 0] = [1, 2]  # three different senders, one copy each
    np.testing.assert_allclose(c.replica_refill_time(reps, home), [w / NVL])


def test_transfer_time_cross_rail():
    c = cost()
    assert c.transfer_time(np.array([0]), np.array([3]), 1000.0) == pytest.approx(1000 / NIC)
    assert c.transfer_time(np.array([0]), np.array([1]), 1000.0) == pytest.approx(1000 / NVL)
    assert c.transfer_time(np.array([], int), np.array([], int), 1000.0) == 0.0


def test_calibration_curve(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"models": {"hand": {"tokens": [0, 100], "seconds": [1e-6, 1e-4]}}}))
    cal = load_calibration(path, "hand")
    assert load_calibration(path, "other") is None
    c = cost(calibration=cal)
    # interpolation, 0 tokens -> 0 s, extrapolation with the last slope
    np.testing.assert_allclose(c.expert_time(np.array([0, 50, 200])), [0, 5.05e-5, 1e-4 + 100 * 99e-8])


def test_calibration_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(bad, "hand")
    bad.write_text(json.dumps({"models": {"hand": {"tokens": [5, 1], "seconds": [1, 2]}}}))
    with pytest.raises(ValueError, match="strictly increasing"):
        load_calibration(bad, "hand")
    with pytest.raises(ValueError, match="at least 2 points"):
        cost(calibration=(np.array([1.0]), np.array([1.0])))


@pytest.mark.parametrize("calibrated", [False, True])
def test_gpu_compute_time_is_the_dense_sum_bit_for_bit(calibrated: bool) -> None:
    """The sparse sum of busy entries gives ``expert_time(assign).sum(axis=-2)`` exactly: fractional,
    dense and sparse rows, zeros and a negative entry (priced 0), and leading axes of any count."""
    cal = (np.array([0.0, 40.0, 300.0]), np.array([1e-6, 3e-5, 2e-4])) if calibrated else None
    c = cost(nodes=2, gpn=4, calibration=cal)
    rng = np.random.default_rng(4)
    dense = rng.gamma(0.7, 60.0, size=(3, 5, 16, 8)) * (rng.random((3, 5, 16, 8)) < 0.6)
    dense[0, 0, 3, 2] = -5.0
    sparse = np.zeros((2, 16, 8))
    sparse[:, np.arange(16), np.arange(16) % 8] = rng.integers(1, 500, size=(2, 16))
    for assign in (dense, sparse, dense[0, 0]):
        want = c.expert_time(assign).sum(axis=-2)
        got = c.gpu_compute_time(assign)
        assert got.shape == want.shape and np.array_equal(got, want)
    assert c.gpu_compute_time(np.zeros((2, 16, 8))).shape == (2, 8)
