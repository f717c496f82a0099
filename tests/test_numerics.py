"""Host-independent numerics (relibra.numerics): equal to the C library element for element, and the
DeepEP planning and pricing inputs bit-identical when numpy's AVX-512 kernels and OpenBLAS's AVX-512
kernels are switched off (what a run on an AVX2 host computes)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relibra import numerics
from relibra.cost.model import CostModel

ROOT = Path(__file__).resolve().parents[1]
FLOATS = st.floats(min_value=-700.0, max_value=700.0, allow_nan=False)


@given(hnp.arrays(np.float64, st.integers(1, 64), elements=FLOATS))
def test_ufuncs_equal_the_c_library(values: np.ndarray) -> None:
    """Every element is Python's ``math`` result, bit for bit (``out=`` too)."""
    cases = [
        (numerics.exp, math.exp, values),
        (numerics.expm1, math.expm1, values),
        (numerics.log, math.log, np.abs(values) + 1e-300),
        (numerics.log1p, math.log1p, np.abs(values) - 0.5),
    ]
    for ufunc, scalar, xs in cases:
        want = np.array([scalar(float(v)) for v in xs])
        assert ufunc(xs).tobytes() == want.tobytes()
        out = np.empty_like(xs)
        ufunc(xs, out=out)
        assert out.tobytes() == want.tobytes()


def test_log_edges_follow_numpy() -> None:
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.array_equal(numerics.log(np.array([0.0, 1.0])), np.array([-np.inf, 0.0]))
        assert np.isnan(numerics.log1p(np.array([-2.0])))[0]
        assert numerics.log1p(np.array([-1.0]))[0] == -np.inf


@settings(deadline=None)  # the first draws compile numba signatures (hundreds of ms on a loaded machine)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(1, 6),
    st.integers(1, 5),
    st.booleans(),
    st.integers(0, 2**31),
)
def test_matmul_sums_in_index_order(lead: int, m: int, k: int, n: int, shared_b: bool, seed: int) -> None:
    """Each element is the products summed in increasing ``k`` (a plain Python loop gives the same bits),
    with broadcast leading axes; sparse ``b`` as the DeepEP shares are."""
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(lead, m, k))
    b = rng.normal(size=(1 if shared_b else lead, k, n)) * (rng.random((1 if shared_b else lead, k, n)) < 0.5)
    got = numerics.matmul(a, b[0] if shared_b else b)
    assert got.shape == (lead, m, n)
    for i in range(lead):
        bi = b[0 if shared_b else i]
        for r in range(m):
            for c in range(n):
                acc = 0.0
                for kk in range(k):
                    if bi[kk, c] != 0.0:
                        acc += float(a[i, r, kk]) * float(bi[kk, c])
                assert got[i, r, c] == acc
    np.testing.assert_allclose(got, a @ b, rtol=1e-12, atol=1e-12)


def test_matmul_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"matmul of shapes \(2, 3\) and \(4, 2\)"):
        numerics.matmul(np.zeros((2, 3)), np.zeros((4, 2)))


def fingerprint() -> dict[str, str]:
    """Hashes of the numbers the DeepEP planners and the cost model derive from one small instance: the
    annealer's problem (``lq``), its annealed placement and objective, the priced DeepEP communication of a
    split assignment, and synthetic counts."""
    from relibra.planners.reorder.config import AnnealConfig
    from relibra.planners.reorder.kernels import anneal_layer
    from relibra.planners.reorder.problem import layer_problem, lpt_placement
    from relibra.trace.synthetic import generate_counts
    from tests.builders import layer_ctx

    def digest(*arrays: np.ndarray) -> str:
        h = hashlib.sha256()
        for arr in arrays:
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()[:20]

    ctx = layer_ctx(2, 4, 32, microbatches=3, seed=7, alpha=0.5)
    cost = CostModel(replace(ctx.cost.cluster, dispatcher="deepep"), ctx.cost.model)
    problem = layer_problem(ctx.load[:, 0], cost)
    home, obj, start = anneal_layer(
        problem, lpt_placement(problem.w.sum(axis=0), 8), ctx.cluster, AnnealConfig(), 3
    )
    rng = np.random.default_rng(11)
    load = ctx.load[:, 0].astype(np.float64)  # [Mb, G, E]
    assign = np.zeros((load.shape[0], load.shape[2], load.shape[1]))
    tokens = load.sum(axis=1)  # [Mb, E]
    for e in range(load.shape[2]):
        gpus = rng.choice(load.shape[1], size=1 + e % 3, replace=False)
        assign[:, e, gpus] = tokens[:, e, None] / gpus.size
    counts = generate_counts("mixed", 64, 3, 4, 1, 32, seed=2)
    return {
        "lq": digest(problem.lq, problem.tok),
        "anneal": digest(home, np.array([obj, start])),
        "deepep_comm": digest(cost.moe_comm_time(load, assign)),
        "counts": digest(np.asarray(counts.counts)),
    }


def _avx512_features() -> list[str]:
    from numpy._core._multiarray_umath import __cpu_features__

    return [f for f in ("AVX512F", "AVX512_SKX", "AVX512_ICL", "AVX512_SPR") if __cpu_features__.get(f)]


def test_deepep_planning_inputs_do_not_depend_on_the_hosts_vector_kernels() -> None:
    """The same numbers with numpy's AVX-512 dispatch and OpenBLAS's AVX-512 kernels switched off: before
    relibra.numerics, numpy's AVX-512 ``log1p`` changed ``lq`` in the last bit and the annealer's trajectory
    with it (the module doc's cell: 4.477956 s against 4.495372 s)."""
    if not _avx512_features():
        pytest.skip("this host has no AVX-512 kernels to switch off: both runs would take the same path")
    env = dict(
        os.environ,
        NPY_DISABLE_CPU_FEATURES="AVX512_SPR AVX512_ICL AVX512_SKX X86_V4",
        OPENBLAS_CORETYPE="Haswell",
    )
    code = "import json; from tests.test_numerics import fingerprint; print(json.dumps(fingerprint()))"
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == fingerprint()
