"""Megatron's micro-batch structure under tensor and context parallelism (relibra/workload.py,
relibra/parallel.py): a micro-batch is ``MBS`` samples per TP x CP group, a step runs ``GBS / (MBS * data
parallel)`` of them, and each GPU routes the ``1 / (tp * cp)`` of the tokens it holds; tokens are conserved
over the split; force-balanced routing stays balanced on every GPU at any CP."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from experiments.config.checks import check_config
from experiments.config.errors import ConfigError
from experiments.config.presets import CONF_DIR
from experiments.config.spec import build_spec
from experiments.validation.end_to_end import load_rows, row_config, row_workload
from relibra.attention_span import FULL_CAUSAL, AttentionSpan
from relibra.parallel import ParallelDims, dense_data_parallel, ep_group_ranks, megatron_microbatches
from relibra.types import SampleCounts
from relibra.workload import build_workload, parallel_workload, rank_tokens, split_counts, split_samples

PUBLISHED = [r for r in load_rows()["rows"] if not r.get("needs")]


def _modelzoo(seq_len: int, cp: int) -> dict[str, Any]:
    """Megatron-MoE-ModelZoo's Qwen3-235B-A22B on 256 H100 (yanring/Megatron-MoE-ModelZoo
    model_configs/benchmarking/Qwen3-235B-A22B.yaml at 1ed4179: bf16, sequence parallel, embedding and loss
    counted in the pipeline split; TP 4, PP 8, VPP 4, EP 8, ETP 1, MBS 1, GBS 256), as a row of the
    end-to-end file's format (no published value is read)."""
    chunks = "[2," + ",".join(["3"] * 30) + ",2]"
    return {
        "id": f"modelzoo/qwen3-235b-a22b/h100x256/tp4pp8vp4ep8cp{cp}/{seq_len}",
        "config": dict(
            gpus=256, global_batch=256, micro_batch=1, seq_len=seq_len, tp=4, pp=8, cp=cp, vp=4, ep=8
        ),
        "overrides": [
            "cluster=hopper",
            "cluster.nodes=1",
            "cluster.gpus_per_node=8",
            "model=qwen3-235b-a22b",
            "cluster.precision=bf16",
            "parallel.tp=4",
            f"parallel.cp={cp}",
            "parallel.pp=8",
            "parallel.vpp=4",
            f"parallel.chunk_layers={chunks}",
            "parallel.dp=4",
            "parallel.gpus=256",
            "simulator.memory_check=off",
        ],
    }


MODELZOO = [_modelzoo(16384, 1), _modelzoo(32768, 2), _modelzoo(65536, 4), _modelzoo(131072, 8)]
"""The ModelZoo's 16K, 32K (CP 2), 64K (CP 4: TP x CP 16 GPUs over EP 8) and 128K (CP 8: 32 GPUs) dims."""


def _light_counts(samples: int, seq_len: int) -> SampleCounts:
    """``samples`` samples of ``seq_len`` tokens, one layer, one expert (the layout reads the tokens only)."""
    return SampleCounts(
        counts=np.full((samples, 1, 1), seq_len * 2, dtype=np.int32),
        tokens=np.full(samples, seq_len, dtype=np.int64),
        batch_offsets=np.array([0, samples], dtype=np.int64),
        top_k=2,
    )


@pytest.mark.parametrize("row", PUBLISHED + MODELZOO, ids=lambda r: r["id"])
def test_micro_batches_and_routed_tokens_follow_megatron(row: dict[str, Any]) -> None:
    conf = row["config"]
    gbs, mbs, seq = conf["global_batch"], conf["micro_batch"], conf["seq_len"]
    tp, cp, pp = (int(conf.get(k) or 1) for k in ("tp", "cp", "pp"))
    # Megatron: data parallel = world / (tp * cp * pp); micro-batches = GBS / (MBS * data parallel);
    # each GPU holds MBS * seq / (tp * cp) tokens of a micro-batch (sequence parallel inside TP, CP's split).
    data_parallel = conf["gpus"] // (tp * cp * pp)
    want_mb = gbs // (mbs * data_parallel)
    want_tokens = mbs * seq // (tp * cp)
    cfg = row_config(row)
    counts, workload = row_workload(cfg, _light_counts(cfg.trace.samples_per_batch, seq))
    parallel, g = cfg.parallel, conf["ep"]
    assert megatron_microbatches(gbs, mbs, parallel, g) == want_mb
    assert (
        dense_data_parallel(parallel, g) * parallel.dp == data_parallel * parallel.dp
    )  # per pipeline replica
    assert workload.num_microbatches == want_mb
    assert (workload.tokens == want_tokens).all()
    # the EP group holds all of its TP x CP groups' ranks, or g of a wider group's tp * cp
    held = min(tp * cp, g)
    assert (
        workload.tokens.sum()
        == counts.tokens.sum()
        == int(cfg.trace.samples_per_batch) * seq * held // (tp * cp)
    )


def test_the_issue_counts_on_modelzoo() -> None:
    """32 micro-batches at 16K (CP 1), 64 at 32K (CP 2), where whole samples per GPU gave 8 and 8."""
    dims = [ParallelDims(tp=4, pp=8, vpp=4, dp=4), ParallelDims(tp=4, cp=2, pp=8, vpp=4, dp=4)]
    assert [megatron_microbatches(256, 1, par, 8) for par in dims] == [32, 64]
    with pytest.raises(ValueError, match="not divisible"):
        megatron_microbatches(250, 1, dims[0], 8)


@pytest.mark.parametrize(("tp", "cp"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (1, 8)])
def test_rank_tokens_take_chunks_i_and_2cp_minus_1_minus_i(tp: int, cp: int) -> None:
    lens = np.array([0, 1, 7, 64, 1000, 4097, 131072])
    parts = rank_tokens(lens, tp, cp)  # [S, tp * cp], rank = cp_rank * tp + tp_rank
    assert (parts.sum(axis=1) == lens).all()
    assert (parts.max(axis=1) - parts.min(axis=1) <= 2).all()  # floor / ceil of each chunk, two chunks
    # chunks i and 2cp - 1 - i: for a length 2 * cp * tp divides, every GPU holds the same tokens and the
    # same causal pairs as FULL_CAUSAL gives the sample's CP chunks
    t = 2 * cp * tp * 16
    held = rank_tokens(np.array([t]), tp, cp)[0]
    assert (held == t // (tp * cp)).all()
    c = t // (2 * cp)
    pos = np.arange(t) + 1.0  # keys each query attends to
    for i in range(cp):
        mine = pos[i * c : (i + 1) * c].sum() + pos[(2 * cp - 1 - i) * c : (2 * cp - i) * c].sum()
        assert mine / tp == pytest.approx(FULL_CAUSAL.split(tp * cp).pairs(held[i * tp : i * tp + 1])[0])


@pytest.mark.parametrize(("tp", "cp"), [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_split_conserves_tokens_and_every_expert(tp: int, cp: int) -> None:
    rng = np.random.default_rng(7)
    lens = rng.integers(0, 300, size=12)
    k, num_l, num_e = 4, 3, 16
    counts = np.stack([[rng.multinomial(t * k, np.ones(num_e) / num_e) for _ in range(num_l)] for t in lens])
    parts = rank_tokens(lens, tp, cp)
    out = split_counts(counts, lens, parts, k)
    n = tp * cp
    assert out.min() >= 0
    assert (out.reshape(12, n, num_l, num_e).sum(axis=1) == counts).all()
    assert (out.sum(axis=-1) == parts.reshape(-1)[:, None] * k).all()
    # an even share: no rank is more than one leftover unit per layer off an expert's share
    share = counts[:, None] * parts[:, :, None, None] / np.maximum(lens, 1)[:, None, None, None]
    assert np.abs(out.reshape(12, n, num_l, num_e) - share).max() < n + 1


def test_tp1_cp1_is_todays_workload() -> None:
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 200, size=40)
    counts = SampleCounts(
        counts=np.stack([[rng.multinomial(t * 2, np.ones(8) / 8)] for t in lens]).astype(np.int32),
        tokens=lens.astype(np.int64),
        batch_offsets=np.array([0, 17, 40]),
        top_k=2,
    )
    assert split_samples(counts, 1, 1) is counts
    span = AttentionSpan(window=16, windowed_share=0.5)
    assert span.split(1) == span
    assert (span.split(1).pairs(lens) == span.pairs(lens)).all()
    a = build_workload(counts, 4, samples_per_microbatch=2, span=span)
    b = build_workload(counts, 4, samples_per_microbatch=2, span=span, group=1)
    for field in ("load", "tokens", "causal_pairs", "sample_gpu", "sample_mb", "mb_batch"):
        assert np.array_equal(getattr(a, field), getattr(b, field))


def test_a_sample_stays_on_its_tp_cp_group() -> None:
    rng = np.random.default_rng(5)
    lens = rng.integers(8, 400, size=48)
    counts = SampleCounts(
        counts=np.stack([[rng.multinomial(t * 2, np.ones(16) / 16)] for t in lens]).astype(np.int32),
        tokens=lens.astype(np.int64),
        batch_offsets=np.array([0, 48]),
        top_k=2,
    )
    n = 4
    ranks = split_samples(counts, 2, 2)
    wl = build_workload(ranks, 16, samples_per_microbatch=1, group=n)
    gpu = wl.sample_gpu.reshape(48, n)
    assert (gpu == gpu[:, :1] + np.arange(n)).all() and (gpu[:, 0] % n == 0).all()
    assert (wl.sample_mb.reshape(48, n) == wl.sample_mb.reshape(48, n)[:, :1]).all()
    assert wl.num_microbatches == 48 // (16 // n)
    assert wl.load.sum() == counts.counts.sum() and wl.tokens.sum() == lens.sum()


def _cfg(*overrides: str):
    small = ["trace.num_batches=1", "trace.samples_per_batch=64", "trace.max_tokens=1024", "logger=none"]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="cp"):
        return compose("config", overrides=[*small, "model=qwen3-30b-a3b", "cluster.nodes=1", *overrides])


def _tokens_held(cp: int, g: int = 8) -> float:
    """Tokens the EP group of ``g`` GPUs holds at CP ``cp``: every token when the CP group nests in it, the
    first ``g`` CP ranks' chunks of every sample when it spans several EP groups."""
    from experiments.config.build import load_counts

    lens = load_counts(build_spec(_cfg())).tokens
    return float(rank_tokens(lens, 1, cp)[:, : min(cp, g)].sum())


@pytest.mark.parametrize("cp", [1, 2, 4, 8, 16])
def test_force_balanced_stays_balanced_on_every_gpu_at_any_cp(cp: int) -> None:
    from experiments.run import compute

    # NOTE: cp samples per TP x CP group keep each GPU's tokens per micro-batch those of CP 1 (the routing's
    # multinomial noise grows as the micro-batch shrinks, whatever the layout); CP 16 spans 2 EP groups of 8
    # (dp 2), each holding 8 of the 16 CP ranks: half the tokens
    wide = ["parallel.dp=2"] if cp > 8 else []
    rows, _, _ = compute(
        check_config(
            _cfg(
                "planner=force_balanced", f"parallel.cp={cp}", f"workload.samples_per_microbatch={cp}", *wide
            )
        )
    )
    row = rows.iloc[0]
    assert row["skew_max"] < 1.1 and row["skew_mean"] < 1.05, (row["skew_max"], row["skew_mean"])
    assert row["tokens"] == _tokens_held(cp)  # tokens conserved over the split


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        (["parallel.cp=0"], ["parallel.cp=0"]),
        (
            ["parallel.cp=3"],
            ["parallel.tp * parallel.cp = 1 * 3 = 3", "cluster.nodes * cluster.gpus_per_node"],
        ),
        (
            ["parallel.tp=4", "parallel.cp=4"],
            ["parallel.tp * parallel.cp = 16 GPUs span 2 EP groups of 8", "parallel.dp * 8 = 8"],
        ),
        (["parallel.tp=4", "parallel.cp=3"], ["parallel.tp * parallel.cp = 4 * 3 = 12", "neither divides"]),
        (
            ["parallel.cp=2", "trace.max_tokens=250"],
            ["trace.max_tokens=250", "2 * parallel.cp * parallel.tp"],
        ),
        (["parallel.tp=2", "trace.max_tokens=251"], ["trace.max_tokens=251", "parallel.tp=2"]),
    ],
)
def test_layouts_megatron_refuses_are_refused(overrides: list[str], keys: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        check_config(_cfg(*overrides))
    for key in keys:
        assert key in str(err.value), (key, str(err.value))


def test_describe_names_the_nodes_of_a_group_wider_than_a_node() -> None:
    text = ParallelDims(tp=4, cp=4).describe(16, 8)
    assert "spans 2 nodes" in text and "CP ranks 4 GPUs apart" in text and "2 consecutive nodes" in text
    assert "spans" not in ParallelDims(tp=4, cp=2).describe(8, 8)


def test_describe_a_group_wider_than_the_ep_group() -> None:
    text = ParallelDims(tp=4, cp=4, dp=2).describe(8, 8)
    assert "spans 2 EP groups" in text and "each holding 2 of its CP ranks" in text


@pytest.mark.parametrize(("tp", "cp", "g"), [(4, 4, 8), (4, 8, 8), (2, 4, 4), (8, 1, 4), (1, 8, 2)])
def test_a_group_wider_than_the_ep_group_holds_its_first_ranks(tp: int, cp: int, g: int) -> None:
    """The EP group holds ranks 0 .. g - 1 of every sample (CP ranks 0 .. g / tp - 1), exactly the rows of
    the whole split; the n / g EP groups together hold every token and every routed slot once."""
    rng = np.random.default_rng(11)
    lens = rng.integers(0, 600, size=10)
    k, num_l, num_e = 2, 2, 8
    counts = SampleCounts(
        counts=np.stack(
            [[rng.multinomial(t * k, np.ones(num_e) / num_e) for _ in range(num_l)] for t in lens]
        ).astype(np.int32),
        tokens=lens.astype(np.int64),
        batch_offsets=np.array([0, 4, 10]),
        top_k=k,
    )
    n = tp * cp
    assert ep_group_ranks(ParallelDims(tp=tp, cp=cp), g) == g
    whole = split_samples(counts, tp, cp)
    mine = split_samples(counts, tp, cp, held=g)
    rows = whole.counts.reshape(10, n, num_l, num_e)
    assert np.array_equal(mine.counts.reshape(10, g, num_l, num_e), rows[:, :g])
    assert np.array_equal(mine.tokens.reshape(10, g), whole.tokens.reshape(10, n)[:, :g])
    assert (rows.sum(axis=1) == counts.counts).all() and whole.tokens.sum() == lens.sum()
    assert mine.batch_offsets.tolist() == [0, 4 * g, 10 * g]
    # the workload: each micro-batch is one sample (MBS 1) over the whole EP group, rank r on GPU r
    _, wl = parallel_workload(counts, ParallelDims(tp=tp, cp=cp), g, samples_per_microbatch=1)
    assert wl.num_microbatches == 10
    assert (wl.sample_gpu.reshape(10, g) == np.arange(g)).all()
    mb = wl.sample_mb.reshape(10, g)
    assert (mb == mb[:, :1]).all() and sorted(mb[:, 0].tolist()) == list(range(10))
    assert np.array_equal(wl.tokens[mb[:, 0]], mine.tokens.reshape(10, g))
    assert wl.load.sum() == mine.counts.sum()


def test_tp_cp_and_ep_groups_that_do_not_nest_are_refused_by_the_workload() -> None:
    with pytest.raises(ValueError, match="neither divides"):
        ep_group_ranks(ParallelDims(tp=4, cp=3), 8)


def test_end_to_end_rows_are_refused_when_cp_disagrees() -> None:
    row = copy.deepcopy(MODELZOO[1])
    row["config"]["cp"] = 1
    with pytest.raises(ValueError, match="CP 2"):
        row_config(row)


def test_relibra_under_tp_and_cp_keeps_every_sample_on_its_group() -> None:
    """ReLibra's sample re-assignment (the locality round) moves nothing when tp * cp > 1: a sample's ranks
    stay on one TP x CP group, in rank order, in one micro-batch; the experts still move."""
    from experiments.run import compute

    cfg = _cfg(
        "model=olmoe-1b-7b",
        "planner=relibra",
        "parallel.tp=2",
        "parallel.cp=2",
        "workload.samples_per_microbatch=2",
        "dump_plans=true",
    )
    rows, _, dump = compute(check_config(cfg))
    assert dump is not None
    gpu, mb = dump["sample_gpu"].reshape(-1, 4), dump["sample_mb"].reshape(-1, 4)
    assert (gpu == gpu[:, :1] + np.arange(4)).all() and (gpu[:, 0] % 4 == 0).all()
    assert (mb == mb[:, :1]).all()
    assert rows.iloc[0]["locality_moved_samples"] == 0.0
    assert rows.iloc[0]["reorder_moved_experts"] > 0


def test_the_relabelling_keeps_tp_cp_groups() -> None:
    """Under tp * cp > 1 a relabelling permutes whole nodes (rails kept); nothing when a group spans nodes."""
    from relibra.relabel import keep_in_place

    rng = np.random.default_rng(11)
    prev = rng.permutation(np.repeat(np.arange(16), 4)).reshape(2, 32)  # [L, E] over 2 nodes x 8 GPUs
    new = (prev + 8) % 16  # the same placement on the other node
    free = keep_in_place(new, prev, 2, 8)
    kept = keep_in_place(new, prev, 2, 8, group=4)
    assert (free[new] == prev).all() and (kept[new] == prev).all()  # a node swap keeps every expert
    assert (kept % 8 == np.arange(16) % 8).all()
    shuffled = np.where(new % 8 < 4, new + 4, new - 4)  # rails 0-3 <-> 4-7: free only without groups
    assert (keep_in_place(shuffled, prev, 2, 8)[shuffled] == prev).all()
    assert (keep_in_place(shuffled, prev, 2, 8, group=4) % 8 == np.arange(16) % 8).all()
    assert (keep_in_place(new, prev, 2, 8, group=16) == np.arange(16)).all()


def test_the_p2p_ring_is_exposed_only_beyond_the_attention_it_hides_behind() -> None:
    from experiments.config.build import build_cluster, build_model
    from relibra.cost.context import cp_exchange_time, kv_bytes_per_token

    cfg = _cfg()
    cluster, model = build_cluster(build_spec(cfg)), build_model(build_spec(cfg))
    hw = cluster.hardware
    tokens = np.full((1, 8), 4096.0)
    par = ParallelDims(tp=2, cp=4)
    assert cp_exchange_time(cluster, model, ParallelDims(tp=2), tokens, np.zeros((1, 8)))[0] == 0.0
    send = 4096 * 2 * kv_bytes_per_token(model, 2) / (hw.nvlink_bytes_per_s * hw.nvlink_efficiency)
    send += hw.alltoall_latency_s
    # no attention to hide behind: cp - 1 sends forward, twice the bytes backward
    bare = cp_exchange_time(cluster, model, par, tokens, np.zeros((1, 8)))[0]
    assert bare == pytest.approx(3 * (send + 2 * send))
    # attention longer than every send: nothing exposed
    assert cp_exchange_time(cluster, model, par, tokens, np.full((1, 8), 1.0))[0] == 0.0
    # a group wider than the NVLink domain rides the rail NIC
    wide = cp_exchange_time(cluster, model, ParallelDims(tp=2, cp=8), tokens, np.zeros((1, 8)))[0]
    nic = 4096 * 2 * kv_bytes_per_token(model, 2) / (hw.nic_bytes_per_s * hw.nic_efficiency)
    assert wide == pytest.approx(7 * 3 * (nic + hw.alltoall_latency_s))
    assert kv_bytes_per_token(model, 8) == 2 * 1 * 2 * model.head_dim  # 4 KV heads: one per GPU at tp 8
