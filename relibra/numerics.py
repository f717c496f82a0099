"""``exp``, ``log``, ``log1p``, ``expm1`` and ``matmul`` that give the same bits on every x86-64 host.

Why: numpy dispatches its float64 transcendental ufuncs on the CPU it runs on (AVX-512 hosts take
vectorised kernels, AVX2 hosts the scalar C library), and the two paths differ in the last bit of some
results. Most numbers do not care, but the annealer is chaotic: one bit of difference in its DeepEP inputs
(``LayerProblem.lq``) changes one Metropolis decision and from there the whole trajectory. Measured: the
cell ``+experiment=overall_deepep model=qwen3-30b-a3b trace.preset=coding planner=relibra seed=0`` gave a
step of 4.477956 s with numpy's AVX-512 kernels and 4.495372 s with them disabled
(``NPY_DISABLE_CPU_FEATURES="AVX512_SPR AVX512_ICL X86_V4"``), on the same machine and code; 4.495372 s is
what an earlier session recorded at commit bdf75d2, so the run-to-run drift the committed DeepEP tables
showed was a change of host between sessions.

OpenBLAS, which numpy's ``@`` calls, picks its kernels by CPU as well (``OPENBLAS_CORETYPE=Haswell`` on the
same machine moved 225 of that cell's 1,536 per-layer DeepEP communication times by one unit in the last
place). :func:`matmul` sums every product in the order of the contracted index, whatever the vector width.

The ufuncs are numba-compiled loops over the C library's scalar functions (``math.exp`` etc., lowered to
libm calls; numba vectorises them with Intel's SVML only where the ``icc_rt`` package is installed, which
is no dependency here, and the test below would fail on such a host), so a host's SIMD width does
not enter. They are used wherever a planner or the cost model takes a transcendental of fractional data, and
:func:`matmul` where the DeepEP estimate contracts them.
Checked by ``tests/test_numerics.py`` (equal to Python's ``math`` element for element, and the DeepEP
planning and pricing inputs bit-identical with numpy's AVX-512 kernels switched off). Not checked: other
instruction sets (aarch64) and other C libraries, whose ``exp`` may round differently.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, vectorize

__all__ = ["exp", "expm1", "log", "log1p", "matmul"]


@vectorize(["float64(float64)"], cache=True)
def exp(x: float) -> float:
    """``exp(x)`` elementwise (a numpy ufunc: ``out=``, broadcasting)."""
    return math.exp(x)


@vectorize(["float64(float64)"], cache=True)
def log(x: float) -> float:
    """``log(x)`` elementwise (``-inf`` at 0, ``nan`` below, with numpy's floating-point warnings)."""
    return math.log(x)


@vectorize(["float64(float64)"], cache=True)
def log1p(x: float) -> float:
    """``log(1 + x)`` elementwise (``-inf`` at -1, ``nan`` below, with numpy's floating-point warnings)."""
    return math.log1p(x)


@vectorize(["float64(float64)"], cache=True)
def expm1(x: float) -> float:
    """``exp(x) - 1`` elementwise."""
    return math.expm1(x)


@njit(cache=True)
def _matmul3(a: np.ndarray, b: np.ndarray, nb: int) -> np.ndarray:
    """[Ba, M, K] @ [Bb, K, N] -> [nb, M, N] (``Ba``, ``Bb`` each 1 or ``nb``), each output summed over ``k``
    in increasing order. ``k`` is the outer loop and zero entries of ``b`` are skipped, so the DeepEP
    estimate's sparse shares (an expert's tokens on one or a few GPUs) cost O(nnz(b) * M)."""
    m = a.shape[1]
    kk, n = b.shape[1], b.shape[2]
    out = np.zeros((nb, m, n))
    for i in range(nb):
        ia = i if a.shape[0] > 1 else 0
        ib = i if b.shape[0] > 1 else 0
        for k in range(kk):
            for c in range(n):
                w = b[ib, k, c]
                if w != 0.0:
                    for r in range(m):
                        out[i, r, c] += a[ia, r, k] * w
    return out


def _stack(x: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """``x`` [..., P, Q] as [1 or prod(lead), P, Q]: unbroadcast when its leading axes are all 1. Always a
    C-contiguous, writeable array (a read-only input, such as a cached workload's, is copied), so the
    kernel is compiled for one array type only."""
    if math.prod(x.shape[:-2]) == 1:
        out = x.reshape(1, *x.shape[-2:])
    else:
        out = np.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(-1, *x.shape[-2:])
    return np.require(out, np.float64, ("C", "W"))


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b``, host-independent: float64 ``a`` [..., M, K], ``b`` [..., K, N], leading axes broadcast.

    Each element is ``sum_k a[..., m, k] * b[..., k, n]`` accumulated in increasing ``k``, every product
    rounded before its addition (numba compiles without fast-math, so no fused multiply-add); zero entries
    of ``b`` are skipped, which leaves each sum as it is except for the sign of an all-zero sum
    (``0.0`` here where BLAS may give ``-0.0``).
    """
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim < 2 or y.ndim < 2 or x.shape[-1] != y.shape[-2]:
        raise ValueError(f"matmul of shapes {x.shape} and {y.shape}: expected [..., M, K] and [..., K, N]")
    lead = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    out = _matmul3(_stack(x, lead), _stack(y, lead), math.prod(lead))
    return out.reshape(*lead, x.shape[-2], y.shape[-1])
