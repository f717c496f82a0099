"""The layer-shared replica buffer: slot copies, reuse across layers, memory independent of layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra.executors.replica_buffer import ReplicaBuffer, SlotCopies
from relibra.executors.torch_executor import launch
from relibra.executors.torch_moe import EPMoEModel, ExpertShape, MicroBatchPlan, expert_init
from relibra.planners.protocols import home_assign, static_placement

SHAPE = ExpertShape(hidden=4, ffn=2)


def test_slot_copies_from_slots() -> None:
    home = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    slots = np.array([[2, -1], [0, 1], [-1, -1], [4, 4]])  # GPU 3 lists expert 4 twice: one copy
    assert SlotCopies.from_slots(slots, home, 0) == SlotCopies(recv=((0, 2, 1),), send=((1, 0, 0), (1, 1, 1)))
    assert SlotCopies.from_slots(slots, home, 1) == SlotCopies(recv=((0, 0, 0), (1, 1, 0)), send=((0, 0, 2),))
    assert SlotCopies.from_slots(slots, home, 2) == SlotCopies(recv=(), send=((3, 0, 4),))
    assert SlotCopies.from_slots(slots, home, 3).recv == ((0, 4, 2),)


@pytest.mark.parametrize("layers", [1, 6])
def test_buffer_memory_does_not_depend_on_layer_count(layers: int) -> None:
    model = EPMoEModel(layers, 8, SHAPE, rank=0, num_gpus=4, replica_slots=3)
    assert model.buffer.nbytes == 2 * 3 * SHAPE.params * 4
    assert ReplicaBuffer(3, SHAPE.params).nbytes == model.buffer.nbytes


def buffer_worker(rank: int, world: int, layers: int) -> dict:
    """Every layer replicates a different expert onto every GPU (same node); track the buffer storage."""
    num_experts, gpn = 8, 2
    home = static_placement(layers, num_experts, world).astype(np.int64)
    replicas = np.full((layers, world, 1), -1, dtype=np.int64)
    for layer in range(layers):
        for g in range(world):
            peer = g ^ 1
            replicas[layer, g, 0] = np.flatnonzero(home[layer] == peer)[layer % 2]
    rng = np.random.default_rng(rank)
    routes = np.argsort(rng.random((5, layers, num_experts)), axis=-1)[..., :2]
    all_routes = [
        np.argsort(np.random.default_rng(j).random((5, layers, num_experts)), axis=-1)[..., :2]
        for j in range(world)
    ]
    load = np.stack(
        [
            np.stack([np.bincount(r[:, layer].ravel(), minlength=num_experts) for layer in range(layers)])
            for r in all_routes
        ],
        axis=1,
    )  # [L, G, E]
    assign = home_assign(load, home, world)
    for layer in range(layers):  # move half of each replicated expert's tokens to its replica
        for g in range(world):
            e = replicas[layer, g, 0]
            half = assign[layer, e, home[layer, e]] // 2
            assign[layer, e, home[layer, e]] -= half
            assign[layer, e, g] += half
    model = EPMoEModel(layers, num_experts, SHAPE, rank, world, replica_slots=1)
    model.place_initial(home)
    ptr, nbytes = model.buffer.weights.data_ptr(), model.buffer.nbytes
    h = torch.randn(5, SHAPE.hidden, requires_grad=True)
    y = model(h, routes, MicroBatchPlan(home, assign, load, replicas))
    after_forward = model.buffer.weights[0].clone()
    y.square().sum().backward()
    assert gpn == 2
    return {
        "same_storage": model.buffer.weights.data_ptr() == ptr and model.buffer.nbytes == nbytes,
        "fills": model.buffer.fills,
        "last_layer_slot_ok": bool(
            torch.equal(after_forward, expert_init(layers - 1, int(replicas[-1, rank, 0]), SHAPE))
        ),
        "first_layer_slot_ok_after_backward": bool(
            torch.equal(model.buffer.weights[0], expert_init(0, int(replicas[0, rank, 0]), SHAPE))
        ),
        "nbytes": nbytes,
    }


@pytest.mark.parametrize("layers", [1, 4])
def test_one_buffer_is_refilled_for_every_layer(layers: int) -> None:
    results = launch(buffer_worker, 4, layers, start_method="fork")
    for rank, res in enumerate(results):
        assert res["same_storage"], rank
        assert res["fills"] == 2 * layers, rank  # one fill per layer forward, one per layer backward
        assert res["last_layer_slot_ok"], rank  # after forward the slot holds the last layer's replica
        assert res["first_layer_slot_ok_after_backward"], rank  # backward ends on layer 0's replica
        assert res["nbytes"] == 2 * SHAPE.params * 4
