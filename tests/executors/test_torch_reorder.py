"""Reordering on real processes: weights, gradients and Adam state follow their experts (gloo, world 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relibra.executors.reorder_ops import moved_experts, reorder_experts
from relibra.executors.torch_executor import launch
from relibra.executors.torch_moe import EPMoEModel, ExpertShape, expert_init
from relibra.planners.protocols import static_placement

SHAPE = ExpertShape(hidden=4, ffn=2)
L, E, G = 3, 8, 4


def _snapshot(model: EPMoEModel, opt: torch.optim.Optimizer) -> dict[tuple[int, int], dict]:
    """(layer, expert) -> its row of weights, gradient and optimizer state, plus the row index."""
    out = {}
    for layer in range(L):
        p = model.experts[layer]
        st = opt.state[p]
        for i, e in enumerate(model.slot_expert[layer]):
            out[(layer, int(e))] = {
                "row": i,
                "w": p.detach()[i].clone(),
                "grad": p.grad[i].clone(),
                "exp_avg": st["exp_avg"][i].clone(),
                "exp_avg_sq": st["exp_avg_sq"][i].clone(),
            }
    return out


def reorder_worker(rank: int, world: int, homes: list[np.ndarray]) -> list[dict]:
    model = EPMoEModel(L, E, SHAPE, rank, world, replica_slots=0)
    model.place_initial(homes[0])
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    snaps = []
    for b, home in enumerate(homes[1:]):
        # A training step leaves optimizer state; a fresh gradient is then accumulated (not yet stepped).
        for p in model.experts:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * b + rank))
        opt.step()
        for layer, p in enumerate(model.experts):
            p.grad = torch.stack(
                [torch.full((SHAPE.params,), 1000.0 * layer + e) for e in model.slot_expert[layer]]
            )
        before = _snapshot(model, opt)
        moved = reorder_experts(model, home, opt)
        snaps.append({"before": before, "after": _snapshot(model, opt), "moved": moved})
    return snaps


@pytest.fixture(scope="module")
def reordered() -> tuple[list[np.ndarray], list]:
    rng = np.random.default_rng(7)
    homes = [static_placement(L, E, G).astype(np.int64)]
    for _ in range(2):
        homes.append(np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)]))
    homes[2][1] = homes[1][1]  # layer 1 does not move in the second reordering
    return homes, launch(reorder_worker, G, homes, start_method="fork")


def test_each_rank_holds_exactly_its_new_home_experts(reordered) -> None:
    homes, ranks = reordered
    for step, home in enumerate(homes[1:]):
        for g, snaps in enumerate(ranks):
            held = sorted(snaps[step]["after"])
            assert held == sorted((layer, int(e)) for layer, e in np.argwhere(home == g)), (step, g)


def test_weights_gradients_and_optimizer_state_travel_with_the_expert(reordered) -> None:
    homes, ranks = reordered
    for step in range(len(homes) - 1):
        before = {k: v for snaps in ranks for k, v in snaps[step]["before"].items()}
        for snaps in ranks:
            for key, now in snaps[step]["after"].items():
                for name in ("w", "grad", "exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(
                        now[name], before[key][name], rtol=0, atol=0, msg=f"{key} {name}"
                    )
                assert float(now["grad"][0]) == 1000.0 * key[0] + key[1]  # the gradient names its expert


def test_first_placement_is_self_identifying() -> None:
    model = EPMoEModel(L, E, SHAPE, rank=2, num_gpus=G, replica_slots=0)
    model.place_initial(static_placement(L, E, G))
    for layer in range(L):
        for i, e in enumerate(model.slot_expert[layer]):
            torch.testing.assert_close(model.experts[layer].detach()[i], expert_init(layer, int(e), SHAPE))
    assert not torch.equal(expert_init(0, 1, SHAPE), expert_init(1, 0, SHAPE))


def test_unmoved_experts_keep_their_rows(reordered) -> None:
    homes, ranks = reordered
    for step in range(len(homes) - 1):
        moved = {tuple(x) for x in moved_experts(homes[step], homes[step + 1])}
        for snaps in ranks:
            for key, now in snaps[step]["after"].items():
                if key not in moved:
                    assert now["row"] == snaps[step]["before"][key]["row"], key
        assert all(snaps[step]["moved"] == len(moved) for snaps in ranks)
    assert not any(layer == 1 for layer, _ in moved_experts(homes[1], homes[2]))


def test_reorder_refuses_an_unbalanced_placement() -> None:
    model = EPMoEModel(1, 4, SHAPE, rank=0, num_gpus=2, replica_slots=0)
    model.place_initial(np.array([[0, 0, 1, 1]]))
    with pytest.raises(ValueError, match="expected E / G = 2"):
        reorder_experts(model, np.array([[0, 0, 0, 1]]))


def mixed_dtype_worker(rank: int, world: int, home: np.ndarray) -> dict:
    """bf16 expert weights with fp32 optimizer state (as master-weight optimizers keep it), moved once."""
    model = EPMoEModel(L, E, SHAPE, rank, world, replica_slots=0)
    model.place_initial(static_placement(L, E, world))
    for p in model.experts:
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for layer, p in enumerate(model.experts):
        # fp32 values a bf16 buffer cannot hold: 1 + e / 1024 + layer / 2**20 names its expert exactly.
        opt.state[p]["master"] = torch.stack(
            [torch.full((SHAPE.params,), 1.0 + e / 1024 + layer / 2**20) for e in model.slot_expert[layer]]
        )
    reorder_experts(model, home, opt)
    return {
        (layer, int(e)): (model.experts[layer].dtype, opt.state[model.experts[layer]]["master"][i].clone())
        for layer in range(L)
        for i, e in enumerate(model.slot_expert[layer])
    }


def test_fp32_state_of_bf16_weights_moves_exactly() -> None:
    rng = np.random.default_rng(3)
    home = np.stack([rng.permutation(np.repeat(np.arange(G), E // G)) for _ in range(L)])
    ranks = launch(mixed_dtype_worker, G, home, start_method="fork")
    held = {key: value for got in ranks for key, value in got.items()}
    assert sorted(held) == [(layer, e) for layer in range(L) for e in range(E)]
    assert moved_experts(static_placement(L, E, G), home).size > 0
    for (layer, e), (dtype, master) in held.items():
        assert dtype == torch.bfloat16
        assert master.dtype == torch.float32
        torch.testing.assert_close(
            master, torch.full_like(master, 1.0 + e / 1024 + layer / 2**20), rtol=0, atol=0
        )
