"""Costs that grow with the experts a GPU hosts (``cluster.hardware.per_expert_costs``,
:mod:`relibra.cost.grouped_gemm`): hand-computed cases, their growth with replicas, and off by default."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from relibra.cluster import ClusterSpec, ModelSpec
from relibra.cost.grouped_gemm import GEMM_CALLS_PER_EXPERT, ROUTING_MAP_BYTES_PER_ENTRY
from relibra.cost.model import CostModel
from relibra.cost.pricing import permute_seconds
from tests.builders import HOPPER, training_spec

MODEL = ModelSpec(
    name="per-expert",
    num_layers=1,
    num_moe_layers=1,
    hidden=64,
    moe_ffn=32,
    num_experts=4,
    top_k=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=2,
    dense_ffn=8,
)
ON = replace(HOPPER, per_expert_costs=True, expert_launch_s=1e-6)
ASSIGN = np.array([[10.0, 4.0], [5.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
"""[E, G]: GPU 0 computes experts 0 and 1, GPU 1 expert 2 and a replica of expert 0."""


def _cost(hw=ON, dispatcher: str = "deepep") -> CostModel:
    cluster = ClusterSpec(nodes=1, gpus_per_node=2, hardware=hw, dispatcher=dispatcher)
    return CostModel(cluster, MODEL, training=training_spec())


def test_launches_by_hand():
    # two hosted experts on each GPU, six GEMMs each, 1 us per launch
    np.testing.assert_allclose(_cost().expert_launch_time(ASSIGN), [12e-6, 12e-6])
    assert GEMM_CALLS_PER_EXPERT == 6


def test_routing_map_by_hand():
    c = _cost()
    rate = HOPPER.hbm_bytes_per_s * HOPPER.hbm_efficiency
    # received slots 15 and 7, two hosted experts each, 37 bytes per entry
    assert ROUTING_MAP_BYTES_PER_ENTRY == 37.0
    np.testing.assert_allclose(c.routing_map_time(ASSIGN), [15 * 2 * 37 / rate, 7 * 2 * 37 / rate])
    # the all-to-all dispatcher builds no receive-side map over its local experts
    assert not _cost(dispatcher="alltoall").routing_map_time(ASSIGN).any()


def test_grows_with_hosted_replicas():
    c = _cost()
    more = ASSIGN.copy()
    more[1] = [3.0, 2.0]  # the same tokens, expert 1 now also replicated on GPU 1
    assert c.expert_launch_time(more)[1] > c.expert_launch_time(ASSIGN)[1]
    assert c.gpu_compute_time(more)[1] > _cost(HOPPER).gpu_compute_time(more)[1]


def test_joins_compute_and_permutation_when_on():
    on, off = _cost(), _cost(HOPPER)
    np.testing.assert_allclose(
        on.gpu_compute_time(ASSIGN), off.gpu_compute_time(ASSIGN) + on.expert_launch_time(ASSIGN)
    )
    received = ASSIGN.sum(axis=-2)
    with_map = permute_seconds(on, received[None, None], ASSIGN[None, None])
    assert with_map is not None
    expected = (on.permute_time(received) + on.routing_map_time(ASSIGN)).max()
    np.testing.assert_allclose(with_map, [[expected]])


def test_off_by_default_keeps_bits():
    c = _cost(HOPPER)
    assert not c.expert_launch_time(ASSIGN).any() and not c.routing_map_time(ASSIGN).any()
    received = ASSIGN.sum(axis=-2)[None, None]
    a, b = permute_seconds(c, received, ASSIGN[None, None]), permute_seconds(c, received)
    assert a is not None and b is not None and np.array_equal(a, b)
