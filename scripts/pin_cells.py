"""Record (``--write``) or check the pinned cells: one small cell per planner config, to full precision.

Usage: ``python scripts/pin_cells.py [--write] [--slow] [--add NAME ...]``.

A behaviour-preserving change (a refactor, a move, a faster kernel) must leave every planner's step time,
skewness, moved experts and communication time bit-identical. ``tests/test_pinned_cells.py`` runs the
same cells and compares them with ``tests/data/pinned_cells.json``; after a change that is *meant* to
alter results (the cost model, the layout, a planner), re-record with ``--write`` and say why in the
commit. ``--slow`` also records the quick-scale EP-32 portfolio cell (``tests/data/pinned_slow.json``).
``--add NAME ...`` records the cells of new planner configs only, leaving every pinned cell as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from experiments.config.presets import CONF_DIR  # noqa: E402

DATA = REPO / "tests" / "data"
METRICS = ("step_time_s", "skew_mean", "reorder_moved_experts", "t_comm_s", "t_compute_s")
"""Result columns pinned (plan_time_s is wall time, so it is not)."""
SMALL = [
    "model=qwen3-30b-a3b",
    "trace.preset=mixed",
    "cluster.nodes=4",
    "trace.num_batches=2",
    "trace.samples_per_batch=64",
    "trace.max_tokens=512",
    "logger=none",
]
"""Qwen3-30B-A3B mixed at EP 32, 2 steps of 64 rollouts of up to 512 tokens: small, every stage runs."""
SLOW = {
    "quick_ep32_portfolio": [
        "+experiment=quick_ep_scaling",
        "cluster.nodes=4",
        "planner=relibra_portfolio",
        "logger=none",
    ]
}
"""The quick-scale cells pinned by the slow test."""


UNPINNED = {
    "relibra_milp": "its MILP solves run under a wall-clock limit: the answer depends on the machine speed",
}
"""Planner configs whose results are not a function of the config alone, and why."""


def planner_configs() -> list[str]:
    """Every planner config (``conf/planner/*.yaml``) but :data:`UNPINNED`, sorted."""
    return sorted(p.stem for p in (CONF_DIR / "planner").glob("*.yaml") if p.stem not in UNPINNED)


def small_cells() -> dict[str, list[str]]:
    """One small cell per planner config: name -> overrides."""
    return {name: [*SMALL, f"planner={name}"] for name in planner_configs()}


def measure(overrides: list[str]) -> dict[str, float]:
    """The pinned metrics of one cell, computed now (no results store)."""
    from hydra import compose, initialize_config_dir

    from experiments.config.checks import check_config
    from experiments.run import compute

    with initialize_config_dir(str(CONF_DIR), version_base="1.3", job_name="pin"):
        cfg = compose("config", overrides=overrides)
    results, _, _ = compute(check_config(cfg))
    row = results.iloc[0]
    return {m: float(row[m]) for m in METRICS if m in row}


def add(names: list[str]) -> int:
    """Pin the small cells of new planner configs ``names`` beside the pinned ones (not re-measured);
    exit status 2 naming a config that does not exist or is pinned already."""
    path = DATA / "pinned_cells.json"
    data = json.loads(path.read_text())
    cells = small_cells()
    for name in names:
        if name not in cells:
            print(
                f"--add {name}: no planner config of that name (conf/planner/*.yaml, not unpinned)",
                file=sys.stderr,
            )
            return 2
        if name in data["metrics"]:
            print(f"--add {name}: pinned already; --write re-records every cell", file=sys.stderr)
            return 2
    for name in names:
        data["metrics"][name] = measure(cells[name])
        data["overrides"][name] = cells[name]
    order = sorted(data["metrics"])
    data = {
        "overrides": {n: data["overrides"][n] for n in order},
        "metrics": {n: data["metrics"][n] for n in order},
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"added {len(names)} cell(s) to {path}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the cells instead of checking them")
    parser.add_argument("--slow", action="store_true", help="also the quick-scale cells")
    parser.add_argument(
        "--add", nargs="+", metavar="NAME", help="record the cells of these new planner configs only"
    )
    args = parser.parse_args()
    if args.add:
        raise SystemExit(add(args.add))
    sets = [("pinned_cells.json", small_cells())] + ([("pinned_slow.json", SLOW)] if args.slow else [])
    failed = 0
    for file, cells in sets:
        measured = {name: measure(overrides) for name, overrides in cells.items()}
        path = DATA / file
        if args.write:
            path.write_text(json.dumps({"overrides": cells, "metrics": measured}, indent=1) + "\n")
            print(f"wrote {len(measured)} cells to {path}")
            continue
        pinned = json.loads(path.read_text())["metrics"]
        for name, values in measured.items():
            if pinned.get(name) != values:
                failed += 1
                print(f"{name}: pinned {pinned.get(name)}, now {values}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
