"""What ``relibra.numerics`` (host-independent ``log1p``, ``expm1``, ``matmul``) costs against numpy's own.

Usage: ``python benchmarks/bench_numerics.py [--rounds 15]``. Times, side by side in one process (each round
runs the numpy call, then the ``relibra.numerics`` one, on the same input; medians over rounds), the calls
the DeepEP paths make per MoE layer at the paper's shapes: the annealer's ``log1p`` of one layer's miss
probabilities (``relibra.planners.reorder.problem.layer_problem``, ``[Mb, E, G]``), and the simulator's
DeepEP estimate (``relibra.cost.fabric.deepep_link_tokens_estimate``: ``log1p`` ``[Mb, G, E]``, two
``matmul`` with the expert shares, ``expm1`` of the results). The last columns scale the difference to one
cell: per layer and batch once (4 batches, 94 MoE layers for Qwen3-235B-A22B, 48 for Qwen3-30B-A3B, 16
micro-batches per batch), an upper bound for the estimate, which the simulator may call more than once per
layer and batch (the replication planners' predictions call it too; not counted here).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from relibra import numerics

# (model, MoE layers, E, G): the DeepEP cells of overall_deepep (EP 32 and EP 64, 4 batches).
CELLS = (("qwen3-30b-a3b", 48, 128, 32), ("qwen3-235b-a22b", 94, 128, 64))
MICROBATCHES, BATCHES = 16, 4


def _median_ms(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def side_by_side(a: Callable[[], object], b: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median ms of ``a`` and of ``b``, alternated round by round (after one warm call each)."""
    a(), b()
    ta, tb = [], []
    for _ in range(rounds):
        ta += _median_ms(a, 1)
        tb += _median_ms(b, 1)
    return statistics.median(ta), statistics.median(tb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="alternated rounds per call")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    table = Table(title="relibra.numerics against numpy (median ms per call, side by side)")
    for col in ("model", "EP", "call", "shape", "numpy ms", "numerics ms", "ratio", "extra s per cell"):
        table.add_column(col, justify="left" if col in ("model", "call", "shape") else "right")
    for name, layers, experts, gpus in CELLS:
        q = rng.random((MICROBATCHES, experts, gpus)) * (8.0 / experts)  # top-8 pick probabilities
        lq = -rng.random((MICROBATCHES, gpus, experts)) * 0.1
        share = np.zeros((MICROBATCHES, experts, gpus))
        share[:, np.arange(experts), rng.integers(0, gpus, experts)] = 1.0  # one home per expert
        nodes = gpus // 8
        share_node = share.reshape(MICROBATCHES, experts, nodes, 8).sum(axis=-1)
        miss = rng.random((MICROBATCHES, gpus, gpus)) * -1.0
        calls = (
            ("annealer log1p", np.log1p, numerics.log1p, (-q,)),
            ("estimate log1p", np.log1p, numerics.log1p, (lq,)),
            ("estimate matmul (GPU)", np.matmul, numerics.matmul, (lq, share)),
            ("estimate matmul (node)", np.matmul, numerics.matmul, (lq, share_node)),
            ("estimate expm1", np.expm1, numerics.expm1, (miss,)),
        )
        for call, np_fn, our_fn, inputs in calls:
            shape = inputs[0].shape
            fast, ours = functools.partial(np_fn, *inputs), functools.partial(our_fn, *inputs)
            t_np, t_ours = side_by_side(fast, ours, args.rounds)
            extra = (t_ours - t_np) / 1e3 * layers * BATCHES
            table.add_row(
                name,
                str(gpus),
                call,
                "x".join(map(str, shape)),
                f"{t_np:.3f}",
                f"{t_ours:.3f}",
                f"{t_ours / t_np:.2f}",
                f"{extra:.2f}",
            )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
