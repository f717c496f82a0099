"""What a moved expert carries and how it arrives (relibra/cost/migration.py), hand-computed."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.config.build import build_cluster, build_cost, build_model
from experiments.config.spec import build_spec
from relibra.cluster import ClusterSpec
from relibra.cost.migration import MigrationPayload, migration_cost, migration_payload, receive_seconds
from relibra.cost.model import CostModel
from relibra.parallel import ParallelDims, expert_data_parallel
from relibra.planners.protocols import static_placement
from tests.builders import HOPPER, cfg, tiny_model

H2D = 40e9


@pytest.mark.parametrize(("d", "want"), [(1, 14.0), (2, 8.0), (8, 3.5)])
def test_each_destination_receives_2_plus_12_over_d_bytes_per_param(d: int, want: float) -> None:
    assert MigrationPayload(expert_data_parallel=d).bytes_per_param == want
    assert expert_data_parallel(ParallelDims(dp=d), ep=16) == d
    c = cfg(f"parallel.dp={d}")
    cluster = build_cluster(build_spec(c))
    assert build_cost(build_spec(c), cluster, build_model(build_spec(c))).migration.bytes_per_param == want


def _moves() -> tuple[CostModel, np.ndarray, np.ndarray, float]:
    """2 nodes x 2 GPUs, 8 experts (2 per GPU), 2 layers: layer 0 swaps experts 0 (GPU 0) and 2 (GPU 1) inside
    node 0; layer 1 swaps experts 0 (GPU 0) and 4 (GPU 2) across the nodes, on rail 0."""
    model = tiny_model(num_experts=8, num_layers=2)
    prev = static_placement(2, 8, 4)
    home = prev.copy()
    home[0, [0, 2]] = [1, 0]
    home[1, [0, 4]] = [2, 0]
    cost = CostModel(ClusterSpec(2, 2, HOPPER), model)
    return cost, prev, home, float(model.expert_params)


@pytest.mark.parametrize("d", [1, 2, 8])
def test_network_path_moves_every_changed_expert_over_the_fabric(d: int) -> None:
    cost, prev, home, params = _moves()
    cost = CostModel(cost.cluster, cost.model, migration=MigrationPayload(expert_data_parallel=d))
    per_expert = params * (2 + 12 / d)
    charge = migration_cost(cost, prev, home)
    assert charge.moved == 4
    assert charge.network_bytes == pytest.approx(4 * per_expert)
    # GPU 0 receives one expert over NVLink (layer 0) and one over its rail NIC (layer 1): the NIC is slower.
    nic = per_expert / (HOPPER.nic_bytes_per_s * HOPPER.nic_efficiency)
    assert charge.seconds == pytest.approx(nic)
    assert charge.exposed_s == charge.seconds


@pytest.mark.parametrize("d", [1, 2, 8])
def test_reload_path_charges_only_the_moves_across_nodes(d: int) -> None:
    cost, prev, home, params = _moves()
    pay = MigrationPayload(expert_data_parallel=d, path="reload", host_to_device_bytes_per_s=H2D)
    cost = CostModel(cost.cluster, cost.model, migration=pay)
    per_expert = params * (2 + 12 / d)
    charge = migration_cost(cost, prev, home)
    assert charge.moved == 4
    assert charge.network_bytes == pytest.approx(2 * per_expert)  # layer 1's two experts cross the nodes
    nic = per_expert / (HOPPER.nic_bytes_per_s * HOPPER.nic_efficiency)  # 40 GB/s, as the host link
    assert charge.seconds == pytest.approx(max(nic, per_expert / H2D))
    inside = prev.copy()
    inside[0, [0, 2]] = [1, 0]
    assert migration_cost(cost, prev, inside).seconds == 0.0
    assert migration_cost(cost, prev, inside).network_bytes == 0.0
    slow = CostModel(
        cost.cluster, cost.model, migration=MigrationPayload(path="reload", host_to_device_bytes_per_s=1e9)
    )
    assert migration_cost(slow, prev, home).seconds == pytest.approx(params * 14 / 1e9)


def test_the_window_hides_only_what_fits_in_it() -> None:
    cost, prev, home, _ = _moves()
    full = migration_cost(cost, prev, home).seconds
    for window, exposed in ((0.0, full), (full / 4, 3 * full / 4), (2 * full, 0.0)):
        pay = MigrationPayload(window_s=window)
        charge = migration_cost(CostModel(cost.cluster, cost.model, migration=pay), prev, home)
        assert charge.seconds == pytest.approx(full)
        assert charge.exposed_s == pytest.approx(exposed)


def test_receive_seconds_are_the_per_expert_form() -> None:
    cost, prev, _, params = _moves()
    r = receive_seconds(cost, prev[0])  # [E, G]
    assert r.shape == (8, 4)
    assert r[0, 0] == 0.0  # at home
    assert r[0, 1] == pytest.approx(params * 14 / (HOPPER.nvlink_bytes_per_s * HOPPER.nvlink_efficiency))
    assert r[0, 2] == pytest.approx(params * 14 / (HOPPER.nic_bytes_per_s * HOPPER.nic_efficiency))


def test_bad_values_name_their_key() -> None:
    with pytest.raises(ValueError, match=r"simulator\.migration\.path=disk"):
        MigrationPayload(path="disk")
    with pytest.raises(ValueError, match=r"simulator\.migration\.window_s=-1"):
        MigrationPayload(window_s=-1.0)
    with pytest.raises(ValueError, match=r"host_to_device_bytes_per_s > 0"):
        MigrationPayload(path="reload")
    with pytest.raises(ValueError, match=r"parallel\.dp"):
        ParallelDims(dp=0)
    with pytest.raises(ValueError, match=r"unknown keys \['optimizer_shards'\]"):
        migration_payload({"optimizer_shards": 2})
