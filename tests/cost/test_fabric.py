"""Both dispatchers' link traffic against counts made by hand on 2 nodes x 2 GPUs.

GPUs: 0 = (node 0, rail 0), 1 = (node 0, rail 1), 2 = (node 1, rail 0), 3 = (node 1, rail 1).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec
from relibra.cost.fabric import (
    LINK_KEYS,
    alltoall_traffic,
    deepep_link_tokens,
    deepep_link_tokens_estimate,
    rail_link_bytes,
)
from relibra.cost.model import CostModel

# token 0: from GPU 0, experts on GPUs 2 and 3 (both on remote node 1)
# token 1: from GPU 1, two experts on GPU 2
# token 2: from GPU 0, experts on GPUs 0 and 1 (its own node)
DEST = np.array([[2, 3], [2, 2], [0, 1]])
SRC = np.array([0, 1, 0])


def test_deepep_crosses_each_remote_node_once():
    got = deepep_link_tokens(DEST, SRC, 2, 2)
    # token 0: RDMA 0 -> 2 (rail 0 of node 1), NVLink 2 -> 3; token 1: RDMA 1 -> 3 (rail 1), NVLink 3 -> 2;
    # token 2: NVLink 0 -> 1 (GPU 0 computes its own expert for free).
    want = {
        "nic_send": [1, 1, 0, 0],
        "nic_recv": [0, 0, 1, 1],
        "nvlink_send": [1, 0, 1, 1],
        "nvlink_recv": [0, 1, 1, 1],
    }
    for k in LINK_KEYS:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_alltoall_sends_one_row_per_token_expert_pair():
    traffic = alltoall_traffic(DEST, SRC, 4)
    want = np.zeros((4, 4))
    want[0, 2] = want[0, 3] = 1  # token 0
    want[1, 2] = 2  # token 1: twice to GPU 2
    want[0, 0] = want[0, 1] = 1  # token 2
    np.testing.assert_array_equal(traffic, want)
    lb = rail_link_bytes(traffic, 2, 2)
    # 0 -> 2 same rail: NIC 0 -> 2. 0 -> 3 cross rail: NVLink 0 -> 1, NIC 1 -> 3.
    # 1 -> 2 (x2) cross rail: NVLink 1 -> 0, NIC 0 -> 2. 0 -> 1: NVLink. 0 -> 0: free.
    np.testing.assert_array_equal(lb["nic_send"], [3, 1, 0, 0])
    np.testing.assert_array_equal(lb["nic_recv"], [0, 0, 3, 1])
    np.testing.assert_array_equal(lb["nvlink_send"], [2, 2, 0, 0])
    np.testing.assert_array_equal(lb["nvlink_recv"], [2, 2, 0, 0])


def test_estimate_is_exact_for_one_token_per_source():
    # one token per source GPU: q = 1 for its experts, 0 otherwise, so the estimate has no randomness.
    dest = np.array([[2, 3], [2, 2], [0, 1], [3, 1]])
    src = np.arange(4)
    e_of_gpu = np.eye(4)  # expert e lives on GPU e
    load = np.zeros((4, 4))
    for j, d in zip(src, dest, strict=True):
        load[j, np.unique(d)] += 1  # distinct experts; a token's two slots on one GPU as one expert here
    est = deepep_link_tokens_estimate(load, e_of_gpu, np.ones(4), 2, 2)
    exact = deepep_link_tokens(dest, src, 2, 2)
    for k in LINK_KEYS:
        np.testing.assert_allclose(est[k], exact[k], atol=1e-9, err_msg=k)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_estimate_conserves_totals_and_matches_exact_on_average(seed):
    rng = np.random.default_rng(seed)
    nodes, gpn, e, k, t = 2, 4, 16, 4, 4000
    g = nodes * gpn
    experts = np.argsort(rng.random((t, e)), axis=1)[:, :k]  # independent uniform routes
    src = rng.integers(0, g, t)
    home = rng.permutation(e) % g
    exact = deepep_link_tokens(home[experts], src, nodes, gpn)
    load = np.zeros((g, e))
    np.add.at(load, (np.repeat(src, k), experts.ravel()), 1)
    share = np.eye(g)[home]
    est = deepep_link_tokens_estimate(load, share, np.bincount(src, minlength=g), nodes, gpn)
    for key in LINK_KEYS:
        # NOTE: independent slots miss the negative correlation of distinct top-k experts: a few % low here.
        assert est[key].sum() == pytest.approx(exact[key].sum(), rel=0.08), key
    # sends equal receives on each link class
    assert est["nic_send"].sum() == pytest.approx(est["nic_recv"].sum())
    assert est["nvlink_send"].sum() == pytest.approx(est["nvlink_recv"].sum())


def _cost(dispatcher: str) -> CostModel:
    hw = HardwareSpec(
        name="hand", bf16_flops=1e12, hbm_bytes_per_s=1e12, nvlink_bytes_per_s=200e9, nic_bytes_per_s=20e9,
        gemm_efficiency=0.7, gemm_half_tokens=128.0, attention_efficiency=0.5,
        alltoall_latency_s=1e-6, nvlink_efficiency=0.5, nic_efficiency=0.5,
    )  # fmt: skip
    model = ModelSpec(
        name="hand", num_layers=1, num_moe_layers=1, hidden=4, moe_ffn=2, num_experts=4, top_k=2,
        num_heads=2, num_kv_heads=1, head_dim=2,
    )  # fmt: skip
    return CostModel(ClusterSpec(nodes=2, gpus_per_node=2, hardware=hw, dispatcher=dispatcher), model)


def test_cost_model_prices_deepep_by_hand():
    # token 0 of the module doc alone, from GPU 0 to experts 2 and 3 (GPUs 2, 3): one token of 8 bytes.
    c = _cost("deepep")
    t = c.route_comm_time(np.array([[2, 3]]), np.array([0]))
    nic, nvl = 8 / 10e9, 8 / 100e9
    # dispatch: GPU 0 sends, GPU 2 receives on the NIC; GPU 2 forwards to 3 over NVLink. Combine mirrors.
    per_pass = np.array([nic, 0.0, nic, nvl])
    np.testing.assert_allclose(t, 2 * (per_pass + per_pass) + 4e-6)
    # the same through the load-based path: x[0, e] = 1 for e = 2, 3; one token at GPU 0
    load = np.zeros((4, 4))
    load[0, [2, 3]] = 1
    np.testing.assert_allclose(c.moe(load, np.eye(4) * load.sum(axis=0)[:, None]).t_comm_gpu, t, rtol=1e-6)


def test_alltoall_pays_twice_for_the_shared_remote_node():
    a, d = _cost("alltoall"), _cost("deepep")
    dest, src = np.array([[2, 3]]), np.array([0])
    assert a.route_comm_time(dest, src).max() > d.route_comm_time(dest, src).max()


def test_unknown_dispatcher_is_refused():
    with pytest.raises(ValueError, match=r"cluster\.dispatcher"):
        _cost("nccl")
