"""Results store: time to write N cells and to load the experiment back (and to skip finished cells).

.venv/bin/python benchmarks/bench_store.py            # 200 cells (default, a few seconds)
.venv/bin/python benchmarks/bench_store.py --cells 2000 --per-layer-rows 4512
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.store.access import load_experiment
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore
from relibra.simulator import METRIC_COLUMNS


def _row(i: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame(
        [
            {
                "model": "qwen3-235b-a22b",
                "dataset": "mixed",
                "planner": "relibra",
                "nodes": 8,
                "gpus_per_node": 8,
                **dict(zip(METRIC_COLUMNS, rng.random(len(METRIC_COLUMNS)))),
            }
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=200)
    parser.add_argument("--per-layer-rows", type=int, default=94 * 16, help="rows per cell (L x M)")
    args = parser.parse_args()
    layers = pd.DataFrame(
        {
            "planner": "relibra",
            "micro_batch": np.arange(args.per_layer_rows) % 16,
            "layer": np.arange(args.per_layer_rows) // 16,
            "skew": 1.0,
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = ResultsStore(Path(tmp))
        configs = [{"model": "qwen3-235b-a22b", "seed": i} for i in range(args.cells)]
        t0 = time.perf_counter()
        for i, cfg in enumerate(configs):
            store.write(cell_key(cfg), _row(i), cfg, layers)
        t1 = time.perf_counter()
        frame = load_experiment(tmp)
        t2 = time.perf_counter()
        done = sum(store.has(cell_key(cfg)) for cfg in configs)
        t3 = time.perf_counter()
    print(f"{'what':<28}{'cells':>8}{'total s':>10}{'ms / cell':>11}")
    for what, n, dt in [
        ("write (+ per-layer table)", args.cells, t1 - t0),
        ("load_experiment", len(frame), t2 - t1),
        ("key + has (resume check)", done, t3 - t2),
    ]:
        print(f"{what:<28}{n:>8}{dt:>10.3f}{1e3 * dt / max(n, 1):>11.2f}")


if __name__ == "__main__":
    main()
