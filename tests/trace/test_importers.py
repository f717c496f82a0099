"""Importers: engine formats (vLLM, SGLang, RouterReplay) and the real traces in ../shared/traces."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest

from relibra.trace.format import TraceFormatError, load_trace, save_trace
from relibra.trace.importers import (
    IncompleteTokensError,
    from_router_replay,
    from_sglang,
    from_vllm,
    load_flame_moe,
    load_mixtral_jsonl,
    load_olmoe_decode,
    load_olmoe_prefill_counts,
    load_qwen3_counts,
)


def routes(seed: int, lengths: list[int], layers: int = 3, experts: int = 16, k: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.argsort(rng.random((t, layers, experts)), axis=-1)[..., :k] for t in lengths]


def test_from_vllm_shapes_and_round_trip(tmp_path: Path) -> None:
    per_sample = routes(0, [5, 1, 7])
    trace = from_vllm(per_sample, num_experts=16, model="toy")
    assert trace.experts.shape == (13, 3, 4) and trace.experts.dtype == np.int16
    assert trace.sample_offsets.tolist() == [0, 5, 6, 13]
    for s, arr in enumerate(per_sample):
        np.testing.assert_array_equal(trace.sample(s), arr)
    back = load_trace(save_trace(trace, tmp_path / "t.npz"))
    np.testing.assert_array_equal(back.experts, trace.experts)


def test_from_vllm_refuses_mixed_shapes() -> None:
    with pytest.raises(ValueError, match=r"routed_experts\[1\]"):
        from_vllm([np.zeros((2, 3, 4), int), np.zeros((2, 2, 4), int)], num_experts=16)
    with pytest.raises(TraceFormatError, match=r"routed_experts\[0\]: expert ids must lie in \[0, 16\)"):
        from_vllm([np.full((2, 3, 1), 16)], num_experts=16)


def test_from_sglang_decodes_base64() -> None:
    per_sample = routes(1, [4, 2])
    encoded = [base64.b64encode(a.astype("<i4").tobytes()).decode() for a in per_sample]
    trace = from_sglang(encoded, num_layers=3, top_k=4, num_experts=16)
    np.testing.assert_array_equal(trace.sample(0), per_sample[0])
    np.testing.assert_array_equal(trace.sample(1), per_sample[1])
    assert trace.meta["source"] == "sglang"
    with pytest.raises(ValueError, match="multiple of"):
        from_sglang([base64.b64encode(b"\0" * 20).decode()], num_layers=3, top_k=4, num_experts=16)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: from_vllm([np.array([[[65539, 7]]])], 16), r"routed_experts\[0\].*\[0, 16\).*65539"),
        (lambda: from_vllm([np.array([[[-65531, 7]]])], 16), r"routed_experts\[0\].*-65531"),
        (lambda: from_vllm([np.array([[[1.0, 7.0]]])], 16), r"routed_experts\[0\] must hold integer"),
        (
            lambda: from_vllm(
                [np.array([[[1, 7]]])], 16, sample_domain=np.array([65536]), domain_names=("a",)
            ),
            r"sample_domain.*65536",
        ),
        (lambda: from_vllm([np.array([[[1, 7]]])], 40000), r"num_experts.*at most 32768"),
        (lambda: from_vllm([np.array([[[1, 7]]])], 64.5), r"num_experts must be a positive integer"),
        (lambda: from_vllm([np.array([[[1, 7]]])], 0), r"num_experts must be a positive integer"),
        (lambda: from_sglang([_b64([70000, 1])], 1, 2, 16), r"routed_experts\[0\].*70000"),
        (lambda: from_sglang([_b64([1, 2])], 0, 2, 16), r"num_layers must be a positive integer"),
        (lambda: from_sglang(["abc"], 1, 2, 16), r"routed_experts\[0\] is not valid base64"),
        (lambda: from_sglang([_b64([1, 2]), "!!!"], 1, 2, 16), r"routed_experts\[1\] is not valid base64"),
        (lambda: from_router_replay([[np.array([[65539, 7]])]], 16), r"routed_experts\[0\].*65539"),
    ],
)
def test_importers_check_range_before_the_int16_cast(make, words: str) -> None:
    with pytest.raises(TraceFormatError, match=words):
        make()


def _b64(ids: list[int]) -> str:
    return base64.b64encode(np.array(ids, dtype="<i4").tobytes()).decode()


def test_from_router_replay_stacks_layers() -> None:
    per_sample = routes(2, [3, 6])
    per_layer = [[a[:, layer] for layer in range(a.shape[1])] for a in per_sample]
    trace = from_router_replay(per_layer, num_experts=16)
    np.testing.assert_array_equal(trace.sample(1), per_sample[1])
    assert trace.meta["source"] == "router_replay"
    with pytest.raises(ValueError, match=r"samples\[0\]"):
        from_router_replay([[np.zeros((3, 4), int), np.zeros((2, 4), int)]], num_experts=16)


def test_mixtral_reports_incomplete_tokens(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = []
    for token in range(3):
        for layer in range(2):
            if token == 1 and layer == 1:
                continue  # token 1 misses layer 1
            rows.append(
                {"dataset": "d", "problem_id": 0, "layer": layer, "experts": [token, 7], "token_idx": token}
            )
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(IncompleteTokensError, match="misses layers \\[1\\]") as err:
        load_mixtral_jsonl(path, num_layers=2)
    assert err.value.tokens[0].token_idx == 1
    trace, dropped = load_mixtral_jsonl(path, drop_incomplete=True, num_layers=2)
    assert [(d.token_idx, d.missing_layers) for d in dropped] == [(1, (1,))]
    assert trace.num_tokens == 2 and trace.experts[1, 0].tolist() == [2, 7]


# --- real traces -------------------------------------------------------------------------------------


@pytest.mark.shared_traces
def test_olmoe_decode(shared_traces: Path) -> None:
    trace = load_olmoe_decode(shared_traces / "olmoe-decode")
    assert trace.experts.shape == (200 * 128, 16, 8)
    assert trace.num_samples == 200 and trace.num_experts == 64
    assert trace.domain_names == ("general", "coding", "math", "reasoning")
    assert trace.sample_domain is not None
    assert np.bincount(trace.sample_domain).tolist() == [50, 50, 50, 50]
    # The first row of a chunk file is token 0, layer 0 (rows sorted by token, then layer).
    with np.load(shared_traces / "olmoe-decode/coding/sequence_0100.npz") as z:
        first = z["requested_expert_ids"][(z["generated_token_index"] == 0) & (z["layer_index"] == 3)][0]
    s = trace.meta["sequence_ids"].index(100)
    np.testing.assert_array_equal(trace.sample(s)[0, 3], first)


@pytest.mark.shared_traces
def test_flame_moe(shared_traces: Path) -> None:
    prefill = load_flame_moe(shared_traces / "flame-moe-290m")
    assert prefill.experts.shape == (2048, 25, 6) and prefill.num_samples == 32
    assert prefill.meta["layer_labels"] == list(range(2, 27))
    decode = load_flame_moe(shared_traces / "flame-moe-290m/decode_positions")
    assert decode.experts.shape == (640, 25, 6) and decode.num_samples == 64


@pytest.mark.shared_traces
def test_mixtral(shared_traces: Path) -> None:
    paths = sorted((shared_traces / "mixtral-8x7b").glob("*.jsonl"))
    with pytest.raises(IncompleteTokensError):
        load_mixtral_jsonl(paths)
    trace, dropped = load_mixtral_jsonl(paths, drop_incomplete=True)
    assert trace.experts.shape[1:] == (32, 2) and trace.num_samples == 4
    assert len(dropped) > 0 and all(d.missing_layers for d in dropped)
    assert trace.num_tokens + len(dropped) == 585


@pytest.mark.shared_traces
def test_count_only_data(shared_traces: Path) -> None:
    prefill = load_olmoe_prefill_counts(shared_traces / "olmoe-prefill-counts")
    assert prefill.counts.shape == (200, 16, 64)
    assert np.all(prefill.counts.sum(-1) == prefill.tokens[:, None] * 8)
    qwen = load_qwen3_counts(shared_traces / "qwen3-moe-counts/counts30b.json")
    assert qwen.counts.shape == (1, 48, 128) and qwen.meta["model"] == "qwen3-30b-a3b"


def test_from_vllm_refuses_meta_that_contradicts_the_routes() -> None:
    routes = [np.zeros((3, 2, 2), dtype=np.int32) + np.array([0, 1])]
    with pytest.raises(TraceFormatError, match=r"meta\['num_experts'\]=4 contradicts the num_experts"):
        from_vllm(routes, num_experts=64, meta={"num_experts": 4})
    with pytest.raises(TraceFormatError, match=r"meta\['top_k'\]=8 contradicts the routes' shape"):
        from_vllm(routes, num_experts=64, meta={"top_k": 8})
    assert from_vllm(routes, num_experts=64, meta={"num_experts": 64, "phase": "x"}).meta["phase"] == "x"


def _olmoe_chunk(path: Path, **arrays: np.ndarray) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {
        "layer_index": np.tile(np.arange(16), 2),
        "generated_token_index": np.repeat(np.arange(2), 16),
        "requested_expert_ids": np.tile(np.arange(8), (32, 1)),
        "sequence_id": np.array([7]),
        "domain_id": np.array([1]),
    }
    np.savez(path, **{k: v for k, v in {**base, **arrays}.items() if v is not None})
    return path


def test_load_olmoe_decode_errors_name_the_file(tmp_path: Path) -> None:
    good = _olmoe_chunk(tmp_path / "good" / "coding" / "sequence_0000.npz")
    assert load_olmoe_decode(good.parents[1]).num_samples == 1
    lacking = _olmoe_chunk(tmp_path / "lacking" / "coding" / "sequence_0000.npz", domain_id=None)
    lacks = rf"{re.escape(str(lacking))}: lacks the arrays \['domain_id'\]"
    with pytest.raises(TraceFormatError, match=lacks):
        load_olmoe_decode(lacking.parents[1])
    objects = _olmoe_chunk(
        tmp_path / "objects" / "coding" / "sequence_0000.npz",
        requested_expert_ids=np.array([[1, 2]] * 32, dtype=object),
    )
    with pytest.raises(TraceFormatError, match=rf"{re.escape(str(objects))}: not a readable OLMoE"):
        load_olmoe_decode(objects.parents[1])


def test_qwen3_counts_that_are_not_such_a_file_are_refused_naming_it(tmp_path) -> None:
    from relibra.trace.importers import load_qwen3_counts

    with pytest.raises(TraceFormatError, match="not a regular file"):
        load_qwen3_counts(tmp_path)
    for name, text in {"bad.json": '{"counts": [1,', "keys.json": '{"x": 1}', "neg.json":
                       '{"counts": [[-1, 2]], "num_layers": 1, "num_experts": 2}'}.items():  # fmt: skip
        (tmp_path / name).write_text(text)
        with pytest.raises(TraceFormatError, match=str(tmp_path / name)):
            load_qwen3_counts(tmp_path / name)
