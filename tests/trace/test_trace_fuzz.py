"""Property tests: the trace loader and every importer fed random malformed input.

Each case either is refused with a :class:`TraceFormatError` whose message names an array (or the file, or
the argument at fault), or is accepted only when it is valid, and then holds exactly the ids it was given
(nothing wrapped around by a cast). Any other exception is a failure.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relibra.trace.format import MAX_EXPERTS, TraceFormatError, load_trace, save_trace
from relibra.trace.importers import from_router_replay, from_sglang, from_vllm
from tests.builders import make_trace

ARRAYS = ("experts", "sample_offsets", "batch_offsets", "sample_domain", "domain_names", "meta")
NAMED = re.compile(
    r"trace array '(" + "|".join(ARRAYS) + r")'|trace file |routed_experts|samples\[\d+\]|"
    r"sample_domain|batch_offsets|num_experts|num_layers|top_k"
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

DTYPES = st.sampled_from(
    [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint64, np.float32, np.float64, np.bool_]
)


def _refused_naming_an_array(call) -> TraceFormatError:
    try:
        call()
    except TraceFormatError as err:
        assert NAMED.search(str(err)), f"message names no array: {err}"
        return err
    raise AssertionError("a malformed input was accepted")


# --- the file loader ---------------------------------------------------------------------------------

GOOD = make_trace()
GOOD_ARRAYS = {
    "experts": GOOD.experts,
    "sample_offsets": GOOD.sample_offsets,
    "batch_offsets": GOOD.batch_offsets,
    "sample_domain": GOOD.sample_domain,
    "domain_names": np.array(GOOD.domain_names),
    "meta": np.array(json.dumps(GOOD.meta)),
}


@st.composite
def malformed_array(draw) -> tuple[str, np.ndarray | None]:
    """(array name, a replacement that breaks the format, or None: the array is left out).

    Every replacement is invalid by construction: a wrong dtype or rank, a value out of range, broken
    offsets, or a required array missing.
    """
    name = draw(st.sampled_from(ARRAYS))
    good = GOOD_ARRAYS[name]
    kind = draw(st.sampled_from(["dtype", "rank", "values", "missing"]))
    if kind == "missing":
        if name in ("experts", "sample_offsets", "meta"):
            return name, None
        kind = "values"
    if name == "meta":
        text = draw(
            st.one_of(
                st.text(max_size=20).filter(lambda t: not _is_valid_meta(t)),
                st.sampled_from(
                    [
                        json.dumps({**GOOD.meta, "num_experts": 0}),
                        json.dumps({**GOOD.meta, "num_experts": 64.5}),
                        json.dumps({**GOOD.meta, "num_experts": "sixty-four"}),
                        json.dumps({**GOOD.meta, "num_experts": MAX_EXPERTS + 1}),
                        json.dumps({**GOOD.meta, "top_k": 3}),
                        json.dumps({k: v for k, v in GOOD.meta.items() if k != "source"}),
                    ]
                ),
            )
        )
        return name, np.array(text) if kind != "rank" else np.array([text])
    if name == "domain_names":
        return name, np.arange(3) if kind != "rank" else np.array([["a", "b"]])
    if kind == "dtype":
        dtype = draw(DTYPES.filter(lambda d: np.dtype(d) != good.dtype))
        return name, good.astype(dtype)
    if kind == "rank":
        return name, good[..., None] if draw(st.booleans()) else np.asarray(good.ravel()[0])
    arr = good.copy()
    idx = draw(st.integers(0, arr.size - 1))
    flat = arr.reshape(-1)
    if name == "experts":
        flat[idx] = draw(st.one_of(st.integers(-(2**15), -1), st.integers(GOOD.num_experts, 2**15 - 1)))
    elif name == "sample_domain":
        flat[idx] = draw(st.one_of(st.integers(-(2**15), -1), st.integers(len(GOOD.domain_names), 2**15 - 1)))
    else:  # offsets: a repeated, decreasing or out-of-range entry
        flat[idx] = flat[idx - 1] if idx else draw(st.integers(1, 2**40))
    return name, arr


def _is_valid_meta(text: str) -> bool:
    try:
        meta = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(meta, dict) and meta == GOOD.meta


@FUZZ
@given(changes=st.lists(malformed_array(), min_size=1, max_size=3, unique_by=lambda c: c[0]))
def test_loader_refuses_malformed_arrays_naming_one(tmp_path: Path, changes) -> None:
    arrays = dict(GOOD_ARRAYS)
    for name, value in changes:
        if value is None:
            del arrays[name]
        else:
            arrays[name] = value
    path = tmp_path / "fuzz.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    _refused_naming_an_array(lambda: load_trace(path))


@FUZZ
@given(data=st.data())
def test_loader_refuses_damaged_files(tmp_path: Path, data) -> None:
    whole = save_trace(GOOD, tmp_path / "whole.npz").read_bytes()
    how = data.draw(st.sampled_from(["truncate", "flip", "random"]))
    if how == "truncate":
        raw = whole[: data.draw(st.integers(0, len(whole) - 1))]
    elif how == "flip":
        # NOTE: a flipped byte of the stored (uncompressed) payload can leave a valid file; flip inside the
        # zip headers and npy headers only (the first 200 bytes hold the first member's headers).
        at = data.draw(st.integers(0, 200))
        raw = whole[:at] + bytes([whole[at] ^ 0xFF]) + whole[at + 1 :]
    else:
        raw = data.draw(st.binary(max_size=512))
    path = tmp_path / "damaged.npz"
    path.write_bytes(raw)
    try:
        trace = load_trace(path)
    except TraceFormatError as err:
        assert NAMED.search(str(err)), f"message names no array: {err}"
        return
    # A byte flip that zip and numpy both accept must still give a trace that validates (it did: it was
    # constructed) and has the format's dtypes; nothing else may come back.
    assert how == "flip" and trace.experts.dtype == np.int16


# --- the importers -----------------------------------------------------------------------------------


def _valid_ids(arrays: list[np.ndarray], num_experts: object) -> bool:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int | np.integer):
        return False
    if not 1 <= num_experts <= MAX_EXPERTS or not arrays:
        return False
    shape = arrays[0].shape[1:] if arrays[0].ndim == 3 else None
    for arr in arrays:
        if arr.ndim != 3 or arr.shape[1:] != shape or arr.dtype.kind not in "iu":
            return False
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= num_experts):
            return False
    if 0 in (shape or (0,)) or any(a.shape[0] == 0 for a in arrays):
        return False
    return all(
        not np.any(np.diff(np.sort(a.astype(np.int64), axis=-1), axis=-1) == 0) for a in arrays if a.size
    )


NUM_EXPERTS = st.one_of(
    st.integers(-3, 70000), st.sampled_from([64.5, "sixty-four", None, True, np.int64(16)])
)
ROUTES = st.lists(
    hnp.arrays(
        dtype=DTYPES,
        shape=st.one_of(
            hnp.array_shapes(min_dims=3, max_dims=3, min_side=0, max_side=3),
            hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=3),
        ),
    ),
    min_size=0,
    max_size=3,
)


def _accepted_exactly(trace, arrays: list[np.ndarray]) -> None:
    expected = np.concatenate([a.astype(np.int64) for a in arrays])
    np.testing.assert_array_equal(trace.experts.astype(np.int64), expected)


@FUZZ
@given(arrays=ROUTES, num_experts=NUM_EXPERTS)
def test_from_vllm_refuses_or_keeps_every_id(arrays: list[np.ndarray], num_experts) -> None:
    if _valid_ids(arrays, num_experts):
        _accepted_exactly(from_vllm(arrays, num_experts), arrays)
    else:
        _refused_naming_an_array(lambda: from_vllm(arrays, num_experts))


@FUZZ
@given(arrays=ROUTES, num_experts=NUM_EXPERTS)
def test_from_router_replay_refuses_or_keeps_every_id(arrays: list[np.ndarray], num_experts) -> None:
    samples = [[a[:, layer] for layer in range(a.shape[1])] if a.ndim == 3 else [a] for a in arrays]
    # what the importer stacks: a 3-D array is [T, L, k]; a lone 2-D one is one layer's [T, k]
    stacked = [a if a.ndim == 3 else a[:, None, :] if a.ndim == 2 else a for a in arrays]
    if _valid_ids(stacked, num_experts):
        _accepted_exactly(from_router_replay(samples, num_experts), stacked)
    else:
        _refused_naming_an_array(lambda: from_router_replay(samples, num_experts))


@FUZZ
@given(
    ids=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12), min_size=1, max_size=3),
    num_layers=st.one_of(st.integers(-1, 3), st.just(2.0)),
    top_k=st.integers(0, 3),
    num_experts=NUM_EXPERTS,
    garble=st.one_of(st.none(), st.integers(0, 40)),
)
def test_from_sglang_refuses_or_keeps_every_id(ids, num_layers, top_k, num_experts, garble) -> None:
    texts = [base64.b64encode(np.array(s, dtype="<i4").tobytes()).decode() for s in ids]
    if garble is not None:  # a character base64 does not have, somewhere in the first sample
        texts[0] = texts[0][:garble] + "!" + texts[0][garble:]
    shaped_ok = (
        garble is None
        and isinstance(num_layers, int)
        and num_layers >= 1
        and top_k >= 1
        and all(len(s) % (num_layers * top_k) == 0 for s in ids)
    )
    arrays = [np.array(s, dtype=np.int64).reshape(-1, num_layers, top_k) for s in ids] if shaped_ok else []
    if shaped_ok and _valid_ids(arrays, num_experts):
        _accepted_exactly(from_sglang(texts, num_layers, top_k, num_experts), arrays)
    else:
        _refused_naming_an_array(lambda: from_sglang(texts, num_layers, top_k, num_experts))
