"""Property tests of the RL trainers' importers: a valid structure, or one broken in one way.

Each case is built in its framework's layout (``tests/trace/rl_builders.py``) from random routes, then
maybe corrupted: a route moved into the padding, a filler overwritten, a duplicate or out-of-range id, a
shifted mask or length, a float or too narrow dtype, a wrong rank. A valid case must come back holding
exactly its recorded routes (a wider dtype changes nothing); a broken one must be refused with a
:class:`TraceFormatError` naming a field. Arbitrary arrays and masks are refused or accepted, never
anything else, and an accepted one never holds more tokens than the mask's real ones.
"""

from __future__ import annotations

import re

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relibra.trace.format import TraceFormatError
from relibra.trace.importers import from_areal, from_nemo_rl, from_skyrl, from_slime, from_verl
from tests.trace.rl_builders import areal_batch, nemo_batch, skyrl_padded, verl_batch

FIELDS = re.compile(
    r"routed_experts|rollout_expert_indices|rollout_routed_experts|attention_mask|input_lengths|"
    r"route_lengths|tokens|moe_layers|num_experts|unrecorded|missing|sample \d+|the mask of sample"
)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FRAMEWORKS = ("verl", "areal", "nemo", "skyrl", "slime")
CORRUPTIONS = (None, "widen", "pad_route", "duplicate", "out_of_range", "shift", "float", "rank")


def _routes(rng: np.random.Generator, lengths: list[int], layers: int, experts: int, k: int) -> list:
    """Distinct ids drawn from [1, E): a route never equals a filler (zeros, or 0..k-1)."""
    return [1 + np.argsort(rng.random((t, layers, experts - 1)), axis=-1)[..., :k] for t in lengths]


@st.composite
def case(draw):  # type: ignore[no-untyped-def]
    framework = draw(st.sampled_from(FRAMEWORKS))
    k = draw(st.integers(2, 3))
    layers = draw(st.integers(1, 3))
    experts = draw(st.integers(k + 2, 40))
    lengths = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    recorded = _routes(rng, lengths, layers, experts, k)
    corruption = draw(st.sampled_from(CORRUPTIONS))
    pick = draw(st.integers(0, 10**6))
    return framework, experts, recorded, corruption, pick


def _build(framework: str, recorded: list[np.ndarray]) -> dict:
    """The framework's structure (arrays in a dict, with the call that imports it)."""
    longest = max(r.shape[0] for r in recorded) + 1
    if framework == "verl":
        routed, mask = verl_batch(recorded, [1] * len(recorded), 1, longest + 1)
        return {"routed": routed, "mask": mask}
    if framework == "areal":
        routed, mask = areal_batch(recorded, longest + 1)
        return {"routed": routed, "mask": mask}
    if framework == "nemo":
        routed, lengths = nemo_batch(recorded, longest + 1, dtype=np.int64)
        return {"routed": routed, "lengths": lengths}
    if framework == "skyrl":
        routed, mask, counts = skyrl_padded(recorded, longest + 1)
        return {"routed": routed.astype(np.int64), "mask": mask, "counts": counts}
    return {"list": [r.copy() for r in recorded]}


def _call(framework: str, data: dict, experts: int):  # type: ignore[no-untyped-def]
    if framework == "verl":
        return from_verl(data["routed"], data["mask"], experts)
    if framework == "areal":
        return from_areal(data["routed"], data["mask"], experts)
    if framework == "nemo":
        return from_nemo_rl(data["routed"], data["lengths"], experts)
    if framework == "skyrl":
        return from_skyrl(data["routed"], experts, attention_mask=data["mask"], route_lengths=data["counts"])
    return from_slime(data["list"], experts)


def _real_positions(framework: str, data: dict) -> list[tuple[int, int]]:
    """(sample, position) of every recorded row, in the input's coordinates."""
    if framework == "slime":
        return [(s, t) for s, a in enumerate(data["list"]) for t in range(a.shape[0])]
    if framework == "nemo":
        real = np.arange(data["routed"].shape[1])[None] < data["lengths"][:, None]
    else:
        real = data["mask"].astype(bool)
    out = []
    for s in range(real.shape[0]):
        pos = np.flatnonzero(real[s])
        out += [(s, int(t)) for t in pos[:-1]]  # every real token but the last is recorded
    return out


def _corrupt(framework: str, data: dict, corruption: str, experts: int, pick: int) -> None:
    """Break ``data`` in place in one way (module doc)."""
    rows = _real_positions(framework, data)
    s, t = rows[pick % len(rows)]
    arr = data["list"][s] if framework == "slime" else data["routed"][s]
    if corruption == "duplicate":
        arr[t, ..., 1] = arr[t, ..., 0]
    elif corruption == "out_of_range":
        arr[t, ..., 0] = experts + pick % 7
    elif corruption == "float":
        if framework == "slime":
            data["list"] = [a.astype(np.float32) for a in data["list"]]
        else:
            data["routed"] = data["routed"].astype(np.float32)
    elif corruption == "rank":
        if framework == "slime":
            data["list"][s] = data["list"][s][:, 0]
        else:
            data["routed"] = data["routed"][..., 0]
    elif corruption == "pad_route":
        if framework == "slime":  # no padding: an extra row where the token count says there is none
            data["tokens"] = [a.shape[0] for a in data["list"]]
        else:
            pad = np.argwhere(_pad_mask(framework, data))
            ps, pt = pad[pick % len(pad)]
            data["routed"][ps, pt] = data["routed"][s, t]
    elif corruption == "shift":
        if framework == "nemo":
            data["lengths"] = data["lengths"] - 1
        elif framework == "skyrl":
            data["counts"] = data["counts"] - 1
        elif framework == "slime":
            data["tokens"] = [a.shape[0] + 2 for a in data["list"]]
        else:
            data["mask"] = np.roll(data["mask"], -1, axis=1)


def _pad_mask(framework: str, data: dict) -> np.ndarray:
    if framework == "nemo":
        return np.arange(data["routed"].shape[1])[None] >= data["lengths"][:, None]
    return ~data["mask"].astype(bool)


@FUZZ
@given(c=case())
def test_rl_importers_keep_exactly_the_routes_or_refuse_naming_a_field(c) -> None:  # type: ignore[no-untyped-def]
    framework, experts, recorded, corruption, pick = c
    data = _build(framework, recorded)
    if corruption == "widen":
        if framework == "slime":
            data["list"] = [a.astype(np.int32) for a in data["list"]]
        else:
            data["routed"] = data["routed"].astype(np.int32 if framework != "areal" else np.int64)
    elif corruption is not None:
        _corrupt(framework, data, corruption, experts, pick)
    if framework == "slime" and "tokens" in data:
        call = lambda: from_slime(data["list"], experts, tokens=data["tokens"])  # noqa: E731
    else:
        call = lambda: _call(framework, data, experts)  # noqa: E731
    if corruption in (None, "widen"):
        trace = call()
        assert trace.num_samples == len(recorded)
        for s, rows in enumerate(recorded):
            np.testing.assert_array_equal(trace.sample(s), rows)
        return
    try:
        call()
    except TraceFormatError as err:
        assert FIELDS.search(str(err)), f"message names no field: {err}"
        return
    raise AssertionError(f"{framework}: a {corruption} input was accepted")


DTYPES = st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.float32, np.bool_])


@FUZZ
@given(
    routed=hnp.arrays(DTYPES, hnp.array_shapes(min_dims=1, max_dims=5, min_side=0, max_side=4)),
    mask=hnp.arrays(
        st.sampled_from([np.int64, np.bool_, np.float32]),
        hnp.array_shapes(min_dims=1, max_dims=3, max_side=4),
    ),
    experts=st.integers(-2, 300),
    framework=st.sampled_from(["verl", "nemo"]),
)
def test_rl_importers_on_arbitrary_arrays(routed, mask, experts, framework) -> None:  # type: ignore[no-untyped-def]
    try:
        if framework == "verl":
            trace = from_verl(routed, mask, experts)
            real = int(np.asarray(mask).astype(bool).sum())
        else:
            lengths = np.asarray(mask).reshape(-1)[: max(routed.shape[0], 1)]
            trace = from_nemo_rl(routed, lengths, experts)
            real = int(np.asarray(lengths).sum())
    except TraceFormatError as err:
        assert FIELDS.search(str(err)), f"message names no field: {err}"
        return
    assert trace.num_tokens <= real
