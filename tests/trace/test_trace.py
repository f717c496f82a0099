"""Routing trace format: round trips, counts, and every malformed input refused with a named array."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from relibra.trace.format import RoutingTrace, TraceFormatError, load_trace, save_trace
from tests.builders import make_trace


def test_round_trip(tmp_path: Path) -> None:
    trace = make_trace()
    path = save_trace(trace, tmp_path / "t.npz")
    back = load_trace(path)
    np.testing.assert_array_equal(back.experts, trace.experts)
    np.testing.assert_array_equal(back.sample_offsets, trace.sample_offsets)
    np.testing.assert_array_equal(back.batch_offsets, trace.batch_offsets)
    np.testing.assert_array_equal(back.sample_domain, trace.sample_domain)
    assert back.domain_names == trace.domain_names
    assert back.meta == trace.meta
    assert not list(tmp_path.glob("*.tmp")), "the atomic write left its temp file behind"


def test_missing_batch_offsets_means_one_batch(tmp_path: Path) -> None:
    trace = make_trace()
    np.savez(
        tmp_path / "t.npz",
        experts=trace.experts,
        sample_offsets=trace.sample_offsets,
        meta=np.array(json.dumps(trace.meta)),
    )
    back = load_trace(tmp_path / "t.npz")
    assert back.num_batches == 1 and back.batch_offsets.tolist() == [0, trace.num_samples]
    assert back.sample_domain is None


def test_to_counts_matches_a_loop() -> None:
    trace = make_trace(seed=3)
    counts = trace.to_counts()
    expected = np.zeros((trace.num_samples, trace.num_layers, trace.num_experts), dtype=np.int64)
    for s in range(trace.num_samples):
        for t in range(trace.sample_offsets[s], trace.sample_offsets[s + 1]):
            for layer in range(trace.num_layers):
                for e in trace.experts[t, layer]:
                    expected[s, layer, e] += 1
    np.testing.assert_array_equal(counts.counts, expected)
    assert counts.counts.dtype == np.int32
    assert np.all(counts.counts.sum(-1) == counts.tokens[:, None] * trace.top_k)


def test_to_counts_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    trace = make_trace(seed=4)
    whole = trace.to_counts().counts
    monkeypatch.setattr("relibra.trace.format._MAX_KEYS_PER_CHUNK", 50)
    np.testing.assert_array_equal(trace.to_counts().counts, whole)


def test_select_samples() -> None:
    trace = make_trace(seed=5)
    sub = trace.select_samples(np.array([3, 1]))
    np.testing.assert_array_equal(sub.sample(0), trace.sample(3))
    np.testing.assert_array_equal(sub.sample(1), trace.sample(1))


def _write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def _arrays(trace: RoutingTrace) -> dict[str, np.ndarray]:
    return {
        "experts": trace.experts,
        "sample_offsets": trace.sample_offsets,
        "batch_offsets": trace.batch_offsets,
        "meta": np.array(json.dumps(trace.meta)),
    }


META = {"num_experts": 8, "top_k": 2, "num_layers": 3, "model": "toy", "source": "test"}


@pytest.mark.parametrize(
    ("change", "array", "words"),
    [
        ({"experts": lambda a: a.astype(np.int32)}, "experts", "dtype"),
        ({"experts": lambda a: a.astype(np.float32)}, "experts", "dtype"),
        ({"experts": lambda a: a[:, 0]}, "experts", "rank"),
        ({"experts": lambda a: np.where(a == 0, 8, a).astype(np.int16)}, "experts", "[0, 8)"),
        ({"experts": lambda a: np.where(a == 0, -1, a).astype(np.int16)}, "experts", "[0, 8)"),
        ({"experts": lambda a: np.repeat(a[..., :1], 2, axis=-1)}, "experts", "same expert twice"),
        ({"sample_offsets": lambda a: a[::-1].copy()}, "sample_offsets", "start at 0"),
        ({"sample_offsets": lambda a: np.r_[a[:3], a[2], a[3:]]}, "sample_offsets", "strictly increasing"),
        ({"sample_offsets": lambda a: np.r_[a[:-1], a[-1] - 1]}, "sample_offsets", "cover"),
        ({"sample_offsets": lambda a: a.astype(np.int32)}, "sample_offsets", "dtype"),
        ({"batch_offsets": lambda a: np.array([0, 12, 5], dtype=np.int64)}, "batch_offsets", "strictly"),
        ({"batch_offsets": lambda a: np.array([0, 5, 11], dtype=np.int64)}, "batch_offsets", "cover"),
        ({"meta": lambda a: np.array("{not json")}, "meta", "JSON"),
        ({"meta": lambda a: np.array(json.dumps([1, 2]))}, "meta", "JSON object"),
        ({"meta": lambda a: np.array(json.dumps({**META, "top_k": 3}))}, "experts", "top_k"),
        ({"meta": lambda a: np.array(json.dumps({**META, "num_layers": 4}))}, "experts", "num_layers"),
        (
            {"meta": lambda a: np.array(json.dumps({k: v for k, v in META.items() if k != "model"}))},
            "meta",
            "missing",
        ),
        ({"meta": lambda a: np.array(json.dumps({**META, "num_experts": "8"}))}, "meta", "positive integer"),
        ({"meta": lambda a: np.array([1.0])}, "meta", "str scalar"),
    ],
)
def test_malformed_file_is_refused(tmp_path: Path, change: dict, array: str, words: str) -> None:
    arrays = _arrays(make_trace())
    for key, fn in change.items():
        arrays[key] = fn(arrays[key])
    path = _write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert f"'{array}'" in str(err.value) and words in str(err.value)


@pytest.mark.parametrize("missing", ["experts", "sample_offsets", "meta"])
def test_missing_array_is_refused(tmp_path: Path, missing: str) -> None:
    arrays = _arrays(make_trace())
    del arrays[missing]
    with pytest.raises(TraceFormatError, match=f"'{missing}': missing"):
        load_trace(_write(tmp_path / "bad.npz", **arrays))


def test_pickled_array_is_refused(tmp_path: Path) -> None:
    arrays = _arrays(make_trace())
    arrays["meta"] = np.array([{"a": 1}], dtype=object)
    with pytest.raises(TraceFormatError, match="pickle"):
        load_trace(_write(tmp_path / "bad.npz", **arrays))


def test_not_an_npz_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.npz"
    path.write_text("hello")
    with pytest.raises(TraceFormatError, match=r"not an \.npz \(zip\) archive"):
        load_trace(path)


def test_empty_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.npz"
    path.write_bytes(b"")
    with pytest.raises(TraceFormatError, match=r"empty\.npz: is empty \(0 bytes\)"):
        load_trace(path)


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9])
def test_truncated_file_is_refused(tmp_path: Path, keep: float) -> None:
    whole = save_trace(make_trace(), tmp_path / "whole.npz").read_bytes()
    path = tmp_path / "cut.npz"
    path.write_bytes(whole[: int(len(whole) * keep)])
    with pytest.raises(TraceFormatError, match=r"cut\.npz"):
        load_trace(path)


def test_random_bytes_are_refused_without_mentioning_pickle(tmp_path: Path) -> None:
    path = tmp_path / "noise.npz"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(TraceFormatError, match=r"not an \.npz") as err:
        load_trace(path)
    assert "pickle" not in str(err.value)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot be read"):
        load_trace(tmp_path / "none.npz")


def test_num_experts_beyond_int16_ids_is_refused() -> None:
    trace = make_trace()
    with pytest.raises(TraceFormatError, match=r"'meta'.*does not fit the int16 ids"):
        _replace(trace, meta={**trace.meta, "num_experts": 40000})


def test_bad_domain_is_refused() -> None:
    trace = make_trace()
    with pytest.raises(TraceFormatError, match="'sample_domain'"):
        RoutingTrace(
            experts=trace.experts,
            sample_offsets=trace.sample_offsets,
            batch_offsets=trace.batch_offsets,
            sample_domain=np.full(trace.num_samples, 2, dtype=np.int16),
            domain_names=("a", "b"),
            meta=trace.meta,
        )
    with pytest.raises(TraceFormatError, match="one entry per sample"):
        _replace(trace, sample_domain=np.zeros(3, dtype=np.int16))


def _replace(trace: RoutingTrace, **changes: object) -> RoutingTrace:
    return dataclasses.replace(trace, **changes)  # type: ignore[arg-type]
