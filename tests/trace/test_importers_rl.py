"""The RL trainers' importers: each framework's layout in, exactly the recorded routes out.

Padding, the unrecorded last token and missing-route sentinels never become routes; dtypes too narrow
for the expert count, misaligned masks and malformed shapes are refused naming the field.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

from relibra.trace.format import TraceFormatError
from relibra.trace.importers import (
    fill_route,
    from_areal,
    from_nemo_rl,
    from_sglang,
    from_skyrl,
    from_slime,
    from_verl,
    from_vllm,
    join_pipeline_stages,
    moe_layers_from_freq,
)
from tests.trace.rl_builders import areal_batch, nemo_batch, sample_routes, skyrl_padded, verl_batch

L, E, K = 3, 16, 4
PROMPTS = [2, 5, 1]
RESPONSES = [4, 1, 6]


@pytest.fixture
def recorded() -> list[np.ndarray]:
    """Every token but the last of three samples (prompt + response - 1 rows each)."""
    rng = np.random.default_rng(0)
    return sample_routes(rng, [p + r - 1 for p, r in zip(PROMPTS, RESPONSES, strict=True)], L, E, K)


def _same(trace, per_sample: list[np.ndarray]) -> None:
    assert trace.num_samples == len(per_sample)
    for s, rows in enumerate(per_sample):
        np.testing.assert_array_equal(trace.sample(s), rows)


# --- verl ------------------------------------------------------------------------------------------
def test_from_verl_keeps_exactly_the_recorded_rows(recorded) -> None:
    routed, mask = verl_batch(recorded, PROMPTS, max_prompt=6, max_response=7)
    trace = from_verl(routed, mask, E, model="toy")
    _same(trace, recorded)
    assert trace.meta["source"] == "verl" and trace.meta["unrecorded_tokens"] == 3
    counts = trace.to_counts()
    # expert 0 is counted only where a recorded route names it: padding zeros and the last token are not
    assert counts.counts[:, :, 0].sum() == sum(int((r == 0).sum()) for r in recorded)
    assert (counts.tokens == [r.shape[0] for r in recorded]).all()


def test_from_verl_fill_keeps_the_last_token_with_the_filler(recorded) -> None:
    routed, mask = verl_batch(recorded, PROMPTS, 6, 7)
    trace = from_verl(routed, mask, E, unrecorded="fill")
    for s, rows in enumerate(recorded):
        np.testing.assert_array_equal(trace.sample(s)[:-1], rows)
        np.testing.assert_array_equal(trace.sample(s)[-1], fill_route(L, K))
    assert trace.meta["unrecorded"] == "fill" and trace.num_tokens == sum(PROMPTS) + sum(RESPONSES)


def test_from_verl_r2_route_lengths_and_moe_layers(recorded) -> None:
    full = [np.concatenate([r, r[:1]]) for r in recorded]  # R2 records every real token
    routed, mask = verl_batch(recorded, PROMPTS, 6, 7)
    for s, rows in enumerate(full):
        start = int(np.argmax(mask[s]))
        routed[s, start : start + rows.shape[0]] = rows
    trace = from_verl(routed, mask, E, route_lengths=mask.sum(1), moe_layers=[2, 0])
    _same(trace, [r[:, [2, 0]] for r in full])
    assert trace.meta["unrecorded_tokens"] == 0 and trace.meta["moe_layers"] == [2, 0]
    with pytest.raises(TraceFormatError, match=r"routed_experts\[0, 9\] is an unrecorded token"):
        from_verl(routed, mask, E)  # without route_lengths the last row must be verl's zero filler


@pytest.mark.parametrize(
    ("corrupt", "words"),
    [
        (lambda r, m: (np.roll(r, 1, axis=1), m), r"routed_experts\[\d+, \d+\] is (padding|an unrecorded)"),
        (lambda r, m: (r, np.roll(m, -1, axis=1)), r"routed_experts\[\d+, \d+\]"),
        (lambda r, m: (r.astype(np.uint8), m), None),  # a dtype that holds E ids: accepted
        (lambda r, m: (r.astype(np.float32), m), r"routed_experts must hold integer"),
        (lambda r, m: (r[..., :1, :], m), None),  # one layer: accepted
        (lambda r, m: (r[:2], m), r"routed_experts must be \[batch, seq, layers, topk\]"),
        (lambda r, m: (r, m * 2), r"attention_mask must hold 0/1"),
        (lambda r, m: (r, np.where(np.arange(m.shape[1]) == 7, 0, m)), r"not one contiguous run"),
        (lambda r, m: (r, np.zeros_like(m)), r"sample 0 has no real token"),
    ],
)
def test_from_verl_refuses_misaligned_or_malformed_input(recorded, corrupt, words) -> None:
    routed, mask = corrupt(*verl_batch(recorded, PROMPTS, 6, 7))
    if words is None:
        assert from_verl(routed, mask, E).num_samples == 3
    else:
        with pytest.raises(TraceFormatError, match=words):
            from_verl(routed, mask, E)


def test_from_verl_refuses_a_zero_route_inside_the_recorded_span(recorded) -> None:
    routed, mask = verl_batch(recorded, PROMPTS, 6, 7)
    routed[1, 3] = 0  # sample 1 starts at 6 - 5 = 1; row 3 is recorded
    with pytest.raises(TraceFormatError, match=r"routed_experts\[1, 3\] names one expert twice"):
        from_verl(routed, mask, E)


def test_narrow_dtypes_are_refused_before_any_cast() -> None:
    rows = np.arange(2 * 2 * 2).reshape(2, 2, 2)
    with pytest.raises(
        TraceFormatError, match=r"dtype uint8, which holds ids up to 255, but num_experts=300"
    ):
        from_slime([rows.astype(np.uint8)], 300)
    with pytest.raises(TraceFormatError, match=r"dtype int8, which holds ids up to 127"):
        from_nemo_rl(np.zeros((1, 3, 2, 2), np.int8), [3], 200)
    with pytest.raises(TraceFormatError, match=r"expert ids must lie in \[0, 8\), found 0\.\.9"):
        from_slime([np.array([[[0, 9]]], dtype=np.int64)], 8)
    with pytest.raises(TraceFormatError, match=r"dtype uint8 holds ids up to 255, but num_experts=300"):
        from_sglang([base64.b64encode(bytes([1, 2])).decode()], 1, 2, 300, dtype="uint8")


# --- AReaL, NeMo-RL, SkyRL, slime --------------------------------------------------------------------
def test_from_areal_left_padded(recorded) -> None:
    routed, mask = areal_batch(recorded, seq=9)
    trace = from_areal(routed, mask, E)
    _same(trace, recorded)
    assert trace.meta["source"] == "areal"
    routed[0, 0] = routed[0, -2]  # a route in the padding
    with pytest.raises(TraceFormatError, match=r"routed_experts\[0, 0\] is padding"):
        from_areal(routed, mask, E)


def test_from_nemo_rl_padded_packed_and_missing(recorded) -> None:
    routed, lengths = nemo_batch(recorded, seq=8)
    _same(from_nemo_rl(routed, lengths, E), recorded)
    packed = np.concatenate([routed[s, : lengths[s]] for s in range(3)])
    _same(from_nemo_rl(packed[None], lengths, E), recorded)
    _same(from_nemo_rl(packed, lengths, E), recorded)
    with pytest.raises(TraceFormatError, match=r"input_lengths must be positive per-sample lengths summing"):
        from_nemo_rl(packed, lengths + 1, E)
    holes, lengths = nemo_batch(recorded, seq=8, missing={0: [1, 2]})
    with pytest.raises(TraceFormatError, match=r"routed_experts\[0, 1\] is a missing route"):
        from_nemo_rl(holes, lengths, E)
    trace = from_nemo_rl(holes, lengths, E, missing="drop")
    np.testing.assert_array_equal(trace.sample(0), np.delete(recorded[0], [1, 2], axis=0))
    assert trace.meta["missing_routes"] == 2
    holes[0, 1, 0, 0] = 3  # a partly negative row is corruption, not the sentinel
    with pytest.raises(TraceFormatError, match=r"routed_experts\[0, 1\]: expert ids must lie in \[0, 16\)"):
        from_nemo_rl(holes, lengths, E, missing="drop")
    routed[2, 7] = routed[2, 0]  # padding must hold the 0..k-1 filler
    with pytest.raises(TraceFormatError, match=r"routed_experts\[2, 7\] is padding"):
        from_nemo_rl(routed, lengths, E)
    with pytest.raises(TraceFormatError, match=r"input_lengths\[0\]=9 lies outside \[1, 8\]"):
        from_nemo_rl(routed, [9, 2, 6], E)


def test_from_skyrl_list_and_padded(recorded) -> None:
    compact = [r.astype(np.uint8) for r in recorded]  # SkyRL's canonical dtype for ids < 256
    trace = from_skyrl(compact, E, tokens=[r.shape[0] + 1 for r in recorded], moe_layers=[0, 2])
    _same(trace, [r[:, [0, 2]] for r in recorded])
    with pytest.raises(TraceFormatError, match=r"rollout_expert_indices\[1\] has 5 rows for a sample of"):
        from_skyrl(compact, E, tokens=[6, 7, 7])
    padded, mask, counts = skyrl_padded(recorded, seq=9)
    _same(from_skyrl(padded, E, attention_mask=mask, route_lengths=counts), recorded)
    with pytest.raises(TraceFormatError, match=r"route_lengths is required"):
        from_skyrl(padded, E, attention_mask=mask)


def test_from_slime_with_dense_layers(recorded) -> None:
    # slime records all num_layers layers; moe_layer_freq [0, 1, 1] marks layer 0 dense
    moe = moe_layers_from_freq(3, [0, 1, 1])
    assert moe == [1, 2] and moe_layers_from_freq(6, 2) == [0, 2, 4]
    trace = from_slime([r.astype(np.int32) for r in recorded], E, moe_layers=moe)
    _same(trace, [r[:, 1:] for r in recorded])
    with pytest.raises(TraceFormatError, match=r"moe_layer_freq must be a positive int or 3 entries"):
        moe_layers_from_freq(3, [1, 2, 1])
    with pytest.raises(TraceFormatError, match=r"moe_layers must be distinct indices in \[0, 3\)"):
        from_slime(recorded, E, moe_layers=[0, 3])
    with pytest.raises(TraceFormatError, match=r"sample 0 has no recorded route"):
        from_slime([np.zeros((0, 3, 4), np.int32)], E)
    assert from_slime([np.zeros((0, 3, 4), np.int32)], E, unrecorded="fill").num_tokens == 1


def test_join_pipeline_stages_interleaved_order() -> None:
    # 2 pipeline ranks x 2 virtual stages of 1 layer: global layers 0, 1, 2, 3 are
    # chunks (pp0, vp0), (pp1, vp0), (pp0, vp1), (pp1, vp1)
    layer = [np.full((5, 1, 2), i) for i in range(4)]
    joined = join_pipeline_stages([[layer[0], layer[2]], [layer[1], layer[3]]])
    assert joined.shape == (5, 4, 2) and (joined[0, :, 0] == [0, 1, 2, 3]).all()
    with pytest.raises(TraceFormatError, match=r"stages\[1\]\[0\] has shape"):
        join_pipeline_stages([[layer[0]], [np.zeros((4, 1, 2), int)]])


def test_vllm_int16_moe_layers_and_sglang_narrow_dtypes(recorded) -> None:
    as_vllm = [r.astype(np.int16) for r in recorded]  # vLLM's routed_experts dtype
    _same(from_vllm(as_vllm, E, moe_layers=[1]), [r[:, [1]] for r in recorded])
    for dtype, code in (("uint8", "u1"), ("uint16", "<u2")):
        texts = [base64.b64encode(r.astype(code).tobytes()).decode() for r in recorded]
        _same(from_sglang(texts, L, K, E, dtype=dtype), recorded)
    with pytest.raises(TraceFormatError, match=r"dtype must be one of"):
        from_sglang(["AA=="], L, K, E, dtype="int64")


# --- with verl's own classes -------------------------------------------------------------------------
def test_from_verl_on_verls_dataproto(recorded) -> None:
    """The batch built as verl's agent loop builds it: verl's padding helpers, ``DataProto``."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("verl", reason="verl is not installed: pip install '.[verl]' (docs/integrations.md)")
    from verl.protocol import DataProto
    from verl.utils.torch_functional import pad_2d_list_to_length, pad_sequence_to_length

    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 99, p).tolist() for p in PROMPTS]
    responses = [rng.integers(5, 99, r).tolist() for r in RESPONSES]
    prompt_ids = torch.cat(
        [pad_sequence_to_length(torch.tensor([p]), 6, 0, left_pad=True) for p in prompts]
    )  # [bs, P]
    response_ids = pad_2d_list_to_length(responses, 0, max_length=7)  # [bs, R]
    prompt_mask = torch.cat(
        [
            pad_sequence_to_length(torch.ones(1, len(p), dtype=torch.long), 6, 0, left_pad=True)
            for p in prompts
        ]
    )
    response_mask = pad_2d_list_to_length([[1] * len(r) for r in responses], 0, max_length=7)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    routed = torch.zeros(
        3, 13, L, K, dtype=torch.int16
    )  # as _postprocess: zeros, the rollout's rows at start
    for s, rows in enumerate(recorded):
        start = 6 - PROMPTS[s]
        routed[s, start : start + rows.shape[0]] = torch.from_numpy(rows)
    batch = DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "routed_experts": routed,
        }
    )
    trace = from_verl(batch.batch["routed_experts"], batch.batch["attention_mask"], E)
    _same(trace, recorded)


@pytest.mark.parametrize("importer", ["verl", "areal", "nemo_rl", "skyrl"])
@pytest.mark.parametrize("shape", [(0, 8, 2, 2), (2, 0, 2, 2)])
def test_an_empty_padded_batch_is_refused_naming_the_field(importer, shape) -> None:
    from relibra.trace import importers_rl as rl

    routed, mask = np.zeros(shape, np.int32), np.zeros(shape[:2], np.int64)
    call = {
        "verl": lambda: rl.from_verl(routed, mask, 8),
        "areal": lambda: rl.from_areal(routed, mask, 8),
        "nemo_rl": lambda: rl.from_nemo_rl(routed, np.zeros(shape[0], np.int64), 8),
        "skyrl": lambda: rl.from_skyrl(
            routed, 8, attention_mask=mask, route_lengths=np.zeros(shape[0], np.int64)
        ),
    }[importer]
    with pytest.raises(TraceFormatError, match=r"(routed_experts|rollout_expert_indices|input_lengths).*"):
        call()


@pytest.mark.parametrize("importer", ["slime", "skyrl"])
@pytest.mark.parametrize(
    ("second", "what"), [((3, 3, 2), "3 layers and top-k 2"), ((3, 2, 3), "2 layers and top-k 3")]
)
def test_list_samples_of_different_layers_or_top_k_are_refused_naming_the_sample(
    importer, second, what
) -> None:
    from relibra.trace import importers_rl as rl

    first = np.tile(np.array([[0, 1], [2, 3]], np.int32), (3, 1, 1))  # 3 rows, 2 layers, top-2
    other = np.tile(np.arange(second[2], dtype=np.int32), (*second[:2], 1))
    call = rl.from_slime if importer == "slime" else rl.from_skyrl
    field = "rollout_routed_experts" if importer == "slime" else "rollout_expert_indices"
    with pytest.raises(TraceFormatError, match=rf"{field}\[1\] has {what}, but {field}\[0\] has 2 and 2"):
        call([first, other], 8)


def test_a_ragged_or_missing_route_list_is_refused_naming_the_field() -> None:
    from relibra.trace import importers_rl as rl
    from relibra.trace.importers import from_vllm

    with pytest.raises(TraceFormatError, match=r"rollout_routed_experts\[0\] is not a rectangular array"):
        rl.from_slime([[[[0, 1], [2]]]], 8)
    with pytest.raises(TraceFormatError, match="routed_experts must be a list of per-sample"):
        from_vllm(None, 8)  # type: ignore[arg-type]
