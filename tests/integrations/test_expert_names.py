"""Physical expert names -> logical checkpoint names (relibra.integrations.expert_names); the export of a
trained physical Megatron model is checked in tests/executors/test_megatron.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra.integrations.expert_names import (
    HF_MIXTRAL_EXPERTS,
    HF_MLP_EXPERTS,
    ExpertNaming,
    ExpertSyncError,
    logical_name,
    strip_router_wrapper,
    to_logical,
)
from relibra.megatron.physical import PhysicalExpertMap, log2phy, next_phy2log

PARTS = ("gate_proj", "up_proj", "down_proj")


def _moved(expert_map: PhysicalExpertMap, num_layers: int, rng: np.random.Generator) -> np.ndarray:
    """phy2log [L, G, E / G] after two random placement moves from the static one."""
    phy2log = expert_map.static_phy2log(num_layers)
    for _ in range(2):
        homes = np.stack(
            [
                rng.permutation(np.repeat(np.arange(expert_map.num_gpus), expert_map.experts_per_gpu))
                for _ in range(num_layers)
            ]
        )
        phy2log = next_phy2log(phy2log, homes)
    return phy2log


def _export(
    expert_map: PhysicalExpertMap, num_layers: int, first: int = 0
) -> list[tuple[str, tuple[int, int, str]]]:
    """What a converter exports from a physical model (every physical id, replica slots included), each
    tensor stood in for by (layer, physical id, part)."""
    return [
        (f"model.layers.{first + layer}.mlp.experts.{p}.{part}.weight", (layer, p, part))
        for layer in range(num_layers)
        for p in range(expert_map.num_physical)
        for part in PARTS
    ]


@settings(max_examples=40, deadline=None)
@given(
    gpus=st.integers(1, 6), per_gpu=st.integers(1, 4), slots=st.integers(0, 3), layers=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)  # fmt: skip
def test_every_logical_expert_once_with_its_home_row(
    gpus: int, per_gpu: int, slots: int, layers: int, seed: int
) -> None:
    expert_map = PhysicalExpertMap(gpus * per_gpu, gpus, slots)
    phy2log = _moved(expert_map, layers, np.random.default_rng(seed))
    homes = log2phy(expert_map, phy2log)  # [L, E]: physical id of each logical expert's home row
    out = dict(to_logical(_export(expert_map, layers), expert_map, phy2log))
    assert len(out) == layers * expert_map.num_experts * len(PARTS)  # replica slots dropped
    for (layer, p, part), e in (
        (v, int(k.split(".experts.")[1].split(".")[0])) for k, v in out.items()
    ):  # the tensor named logical e is the one of e's home row
        assert homes[layer, e] == p and part in PARTS
    replica = expert_map.replica_id(0, 0) if slots else None
    if replica is not None:
        assert (
            logical_name(f"model.layers.0.mlp.experts.{replica}.up_proj.weight", expert_map, phy2log) is None
        )


def test_a_loaded_row_reads_its_logical_expert_and_replica_slots_read_nothing() -> None:
    expert_map = PhysicalExpertMap(
        8, 2, 1
    )  # rank 0: physical 0-3 home, 4 replica; rank 1: 5-8 home, 9 replica
    phy2log = expert_map.static_phy2log(1)
    phy2log[0, 1] = [7, 4, 5, 6]
    assert logical_name("model.layers.0.mlp.experts.5.gate_proj.weight", expert_map, phy2log) == (
        "model.layers.0.mlp.experts.7.gate_proj.weight"
    )
    assert logical_name("model.layers.0.mlp.experts.9.gate_proj.weight", expert_map, phy2log) is None
    assert logical_name("model.layers.0.self_attn.q_proj.weight", expert_map, phy2log) == (
        "model.layers.0.self_attn.q_proj.weight"
    )


def test_dense_first_layers_map_through_moe_layers() -> None:
    """DeepSeek-V3's first layers are dense: checkpoint layer 3 is MoE layer 0 when moe_layers starts at 3."""
    expert_map = PhysicalExpertMap(4, 2, 0)
    phy2log = np.stack(
        [expert_map.static_phy2log(1)[0], expert_map.static_phy2log(1)[0][::-1]]
    )  # layer 1 swapped
    out = dict(to_logical(_export(expert_map, 2, first=3), expert_map, phy2log, moe_layers=[3, 4]))
    assert out["model.layers.4.mlp.experts.0.up_proj.weight"] == (1, 2, "up_proj")
    with pytest.raises(ExpertSyncError, match="layer 2 holds routed experts but is not in moe_layers"):
        list(to_logical(_export(expert_map, 1, first=2), expert_map, phy2log, moe_layers=[3, 4]))


def test_a_missing_or_doubled_expert_is_refused_with_the_layer_and_weight() -> None:
    expert_map = PhysicalExpertMap(4, 2, 1)
    phy2log = expert_map.static_phy2log(2)
    pairs = [
        pair for pair in _export(expert_map, 2) if pair[0] != "model.layers.1.mlp.experts.1.down_proj.weight"
    ]
    with pytest.raises(
        ExpertSyncError, match=r"layer 1, model\.layers\.1\.mlp\.experts\.\{e\}\.down_proj.*missing \[1\]"
    ):
        list(to_logical(pairs, expert_map, phy2log))
    doubled = phy2log.copy()
    doubled[0, 1] = [0, 3]  # expert 0 at home on both ranks, expert 2 nowhere
    with pytest.raises(ExpertSyncError, match=r"missing \[2\], exported more than once \[0\]"):
        list(to_logical(_export(expert_map, 2), expert_map, doubled))


def test_out_of_range_ids_and_bad_patterns_are_refused() -> None:
    expert_map = PhysicalExpertMap(4, 2, 1)
    with pytest.raises(ExpertSyncError, match="physical expert 6: the expert map has 6"):
        logical_name("model.layers.0.mlp.experts.6.up_proj.weight", expert_map, expert_map.static_phy2log(1))
    with pytest.raises(ExpertSyncError, match=r"layer 1: the placement has MoE layers 0\.\.0"):
        logical_name("model.layers.1.mlp.experts.0.up_proj.weight", expert_map, expert_map.static_phy2log(1))
    with pytest.raises(ValueError, match="needs the groups 'layer' and 'expert'"):
        ExpertNaming(r"layers\.(\d+)\.experts\.(\d+)")


def test_mixtral_naming_and_router_names() -> None:
    expert_map = PhysicalExpertMap(4, 2, 1)
    phy2log = expert_map.static_phy2log(1)
    phy2log[0] = [[2, 3], [0, 1]]
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight"  # rank 1, row 0
    assert (
        logical_name(name, expert_map, phy2log, HF_MIXTRAL_EXPERTS)
        == "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    )
    assert logical_name(name, expert_map, phy2log, HF_MLP_EXPERTS) == name  # not an HF_MLP_EXPERTS name
    assert (
        strip_router_wrapper("decoder.layers.2.mlp.router.logical.weight")
        == "decoder.layers.2.mlp.router.weight"
    )
    assert strip_router_wrapper("decoder.layers.2.mlp.router.weight") == "decoder.layers.2.mlp.router.weight"
