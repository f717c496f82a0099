"""Megatron-LM vs Balanced over the synthetic presets for the four models, and the simulator's own speed.

Usage: ``python benchmarks/bench_spine.py [--full] [--presets reasoning,mixed]``. By default: 1 node x 8
GPUs, 2 batches of 64 samples up to 2048 tokens. ``--full``: 4 nodes x 8 GPUs, 2 batches of 512 samples up
to 8192 tokens (minutes and several GiB on a laptop). Prints one table: simulated step time, throughput,
skewness, Balanced / Megatron throughput ratio, and the wall-clock seconds of ``simulate``.
"""

from __future__ import annotations

import argparse

from _common import timed_simulation
from hydra import compose, initialize_config_dir
from rich.console import Console
from rich.table import Table

MODELS = ("olmoe-1b-7b", "qwen3-30b-a3b", "glm4.5-106b-a12b", "qwen3-235b-a22b")
CONF = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "experiments" / "conf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="paper-scale batches on 4 x 8 GPUs")
    ap.add_argument("--presets", default="reasoning", help="comma-separated synthetic presets")
    args = ap.parse_args()
    scale = (
        ["cluster.nodes=4", "trace.samples_per_batch=512", "trace.max_tokens=8192"]
        if args.full
        else ["cluster.nodes=1", "trace.samples_per_batch=64", "trace.max_tokens=2048"]
    )
    table = Table(title="Megatron-LM vs Balanced (simulated)")
    for col in (
        "preset",
        "model",
        "planner",
        "step s",
        "tokens/s",
        "skew mean",
        "skew max",
        "bal/mega",
        "sim s",
    ):
        table.add_column(col, justify="right")
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for preset in args.presets.split(","):
            for model_name in MODELS:
                thr = {}
                for planner_name in ("megatron", "balanced"):
                    cfg = compose(
                        config_name="config",
                        overrides=[
                            f"model={model_name}",
                            f"planner={planner_name}",
                            f"trace.preset={preset}",
                            *scale,
                        ],
                    )
                    res, wall = timed_simulation(cfg)
                    m = res.metrics
                    thr[planner_name] = m["throughput_tokens_per_s"]
                    ratio = f"{thr['balanced'] / thr['megatron']:.3f}" if len(thr) == 2 else ""
                    table.add_row(
                        preset,
                        model_name,
                        planner_name,
                        f"{m['step_time_s']:.3f}",
                        f"{m['throughput_tokens_per_s']:.0f}",
                        f"{m['skew_mean']:.3f}",
                        f"{m['skew_max']:.3f}",
                        ratio,
                        f"{wall:.2f}",
                    )
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
