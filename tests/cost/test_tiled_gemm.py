"""Tile and wave quantisation of the expert grouped GEMMs (``cluster.hardware.gemm_model=tiled``,
:mod:`relibra.cost.grouped_gemm`) against hand-computed cases, and the default path unchanged."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from experiments.config.resolvers import load_option
from relibra.cluster import ClusterSpec, HardwareSpec, ModelSpec, grouped_gemm_problems
from relibra.cost.grouped_gemm import TiledGemm
from relibra.cost.model import CostModel
from tests.builders import HOPPER, REPO

FAST_HBM = 1e30
"""HBM bytes/s so fast that no kernel hits its memory floor (the hand cases count FLOPs only)."""


def _model(hidden: int, ffn: int, experts: int = 4) -> ModelSpec:
    return ModelSpec(
        name="tiles",
        num_layers=1,
        num_moe_layers=1,
        hidden=hidden,
        moe_ffn=ffn,
        num_experts=experts,
        top_k=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
        dense_ffn=8,
    )


def test_hand_computed_case():
    # hidden 4, ffn 2, BM = BN = 2, 2 SMs at 5e11 FLOP/s (2.5e11 each); one GPU, experts with 3 and 1 tokens:
    # row tiles 2 + 1 = 3, the longest expert 2 chunks. Per kernel (tiles, waves, FLOPs per wave-tile):
    #   fc1 fwd   N 4 K 4: 3 * 2 = 6 tiles, 3 waves, 2*2*2*4 = 32 -> 96
    #   fc2 fwd   N 4 K 2: 6 tiles, 3 waves, 16 -> 48
    #   fc2 dgrad N 2 K 4: 3 tiles, 2 waves, 32 -> 64
    #   fc1 dgrad N 4 K 4: 6 tiles, 3 waves, 32 -> 96
    #   fc1 wgrad 4 x 4 out: 4 tiles, 12 units, max(6, 2) = 6 waves of 2*2*2*2 = 16 -> 96
    #   fc2 wgrad 2 x 4 out: 2 tiles, 6 units, max(3, 2) = 3 waves, 16 -> 48
    t = TiledGemm(4, 2, 2, 2, 2, 5e11, FAST_HBM).gpu_seconds(np.array([[3.0], [1.0]]))
    np.testing.assert_allclose(t, [448 / 2.5e11], rtol=1e-12)


def test_full_tiles_cost_exactly_the_flops():
    # Every count a multiple of BM and tiles that fill whole waves (4 SMs, BM = BN = 2, hidden 4, ffn 2,
    # 4 experts of 2 tokens): the six kernels cost the expert FLOPs at the achievable rate, nothing more.
    a = np.full((4, 1), 2.0)
    t = TiledGemm(4, 2, 2, 2, 4, 5e11, FAST_HBM).gpu_seconds(a)
    flops = 3 * 2 * (3 * 4 * 2) * a.sum()  # fwd + bwd, 2 FLOPs per weight per token, W = 3 h f
    np.testing.assert_allclose(t, [flops / 5e11], rtol=1e-12)


def test_monotone_in_tokens():
    n = np.arange(0, 700, dtype=np.float64)
    a = n[:, None, None]  # [N, E=1, G=1]
    t = TiledGemm(2048, 768, 128, 128, 132, 989e12 * 0.7, 3.35e12 / 2).gpu_seconds(a)[:, 0]
    assert t[0] == 0.0
    assert np.all(np.diff(t) >= 0)
    assert t[129] > t[128]  # a second row tile


def test_wave_step_at_sms_plus_one_tiles():
    # BM 1, hidden 2, ffn 1, BN 2: every M-grouped kernel has one tile per token; E experts of one token
    # each on S = 4 SMs: one wave up to 4 tiles, two from 5.
    sms = 4

    def t(experts: int) -> float:
        return float(TiledGemm(2, 1, 1, 2, sms, 1e12, FAST_HBM).gpu_seconds(np.ones((experts, 1)))[0])

    assert t(sms) == t(sms - 1)
    assert t(sms + 1) > t(sms) * 1.4


def test_memory_floor_per_kernel():
    # hidden 4, ffn 2, one expert of 1 token, HBM so slow that every kernel is bound by its weight read:
    # the six kernels read 16 + 8 + 8 + 16 + 16 + 8 = 72 weight elements (each weight once per pass).
    t = TiledGemm(4, 2, 2, 2, 2, 5e11, 1.0).gpu_seconds(np.array([[1.0]]))
    np.testing.assert_allclose(t, [72.0])


def _cost(hw: HardwareSpec, gpus: int = 2, model: ModelSpec | None = None, **kw) -> CostModel:
    cluster = ClusterSpec(nodes=1, gpus_per_node=gpus, hardware=hw, **kw)
    return CostModel(cluster, model or _model(2048, 768, experts=4))


TILED = replace(HOPPER, gemm_model="tiled", gemm_tile_m=128, gemm_tile_n=128)


def test_splitting_below_a_tile_costs_more_than_keeping_together():
    # 100 tokens of one expert (below the 128-row tile): kept on GPU 0, or split 50 / 50 over a replica on
    # GPU 1. Tiled: each half still computes a whole row tile, so the split's GPU-seconds double and its
    # busiest GPU gains nothing; the smooth curve rewards the split (each half at its weight-read floor).
    together = np.zeros((4, 2))
    together[0, 0] = 100
    split = np.zeros((4, 2))
    split[0] = [50, 50]
    tiled = _cost(TILED)
    t_together, t_split = tiled.gpu_compute_time(together), tiled.gpu_compute_time(split)
    assert t_split.sum() > 1.9 * t_together.sum()
    assert t_split.max() == t_together.max()
    smooth = _cost(HOPPER)
    assert smooth.gpu_compute_time(split).max() < smooth.gpu_compute_time(together).max()


def test_waves_span_all_experts_of_a_gpu():
    # Not a per-expert function: two experts of 128 tokens on one GPU share waves.
    c = _cost(TILED, gpus=1)
    one = np.array([[128.0], [0.0], [0.0], [0.0]])
    two = np.array([[128.0], [128.0], [0.0], [0.0]])
    assert c.gpu_compute_time(two)[0] < 2 * c.gpu_compute_time(one)[0]


def test_vectorised_over_leading_axes():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 400, size=(3, 2, 4, 2)).astype(np.float64) * (rng.random((3, 2, 4, 2)) < 0.6)
    c = _cost(TILED)
    batch = c.gpu_compute_time(a)
    assert batch.shape == (3, 2, 2)
    for i in range(3):
        for j in range(2):
            np.testing.assert_array_equal(batch[i, j], c.gpu_compute_time(a[i, j]))


def test_default_is_smooth_and_keeps_its_bits():
    assert HOPPER.gemm_model == "smooth" and not HOPPER.per_expert_costs
    rng = np.random.default_rng(7)
    a = rng.integers(0, 3000, size=(5, 3, 4, 2)).astype(np.float64) * (rng.random((5, 3, 4, 2)) < 0.5)
    c = _cost(HOPPER)
    assert np.array_equal(c.gpu_compute_time(a), c.expert_time(a).sum(axis=-2))


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"gemm_model": "exact"}, "gemm_model"),
        ({"gemm_model": "tiled", "gemm_tile_m": 128, "gemm_tile_n": 128, "sms": 0}, "sms"),
        ({"gemm_model": "tiled", "gemm_tile_n": 128}, "gemm_tile_m"),
        ({"per_expert_costs": "yes"}, "per_expert_costs"),
        ({"expert_launch_s": -1.0}, "expert_launch_s"),
    ],
)
def test_bad_settings_refused(change, key):
    with pytest.raises(ValueError, match=f"cluster.hardware.{key}"):
        replace(HOPPER, **change)


def test_tiled_with_a_calibration_table_refused():
    cluster = ClusterSpec(nodes=1, gpus_per_node=2, hardware=TILED)
    table = (np.array([1.0, 1000.0]), np.array([1e-5, 1e-3]))
    with pytest.raises(ValueError, match="gemm_model=tiled"):
        CostModel(cluster, _model(2048, 768), calibration=table)


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "experiments/conf/cluster").glob("*.yaml")))
def test_every_cluster_yaml_can_tile(name):
    # Every cluster yaml holds the settings, off by default, with tiles and an SM count a tiled run needs.
    hw = HardwareSpec(**load_option("cluster", name)["hardware"])
    assert hw.gemm_model == "smooth" and hw.per_expert_costs is False
    tiled = replace(hw, gemm_model="tiled")
    assert tiled.gemm_tile_m >= 1 and tiled.gemm_tile_n >= 1 and tiled.sms >= 1


def test_config_check_names_the_keys():
    assert grouped_gemm_problems("smooth", 0, 0, 0, False) == []
    problems = grouped_gemm_problems("tiled", 128, 0, 132, "yes")
    assert problems == [
        "cluster.hardware.per_expert_costs='yes': must be true or false",
        "cluster.hardware.gemm_tile_n=0: gemm_model=tiled needs an integer >= 1",
    ]
