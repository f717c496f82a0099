"""The cost model beside published measurements: ``python -m experiments.validate``.

Prints one table: each published quantity, the model's value, their ratio (model / published) and whether
the quantity was a calibration input (its link rate was fitted to it) or an independent check. Sources
(each committed file under ``experiments/data`` names its origin and commit):

* DeepEP / Hybrid-EP bottleneck bandwidths (``deepep_bandwidth.json``): calibration of the achievable
  NVLink and RDMA rates (:mod:`relibra.cost.linkrates`) and checks at EP 16;
* DeepGEMM grouped-GEMM throughput (``deepgemm_grouped.json``): check of the small-count curve
  ``eff(n) / eff(8192)`` of :meth:`relibra.cost.model.CostModel.expert_time`;
* DeepSeek-V3's public training profile (``deepseek_v3_train_profile.json``, extracted from
  deepseek-ai/profile-data ``train.json`` by ``--extract-profile``): per MoE layer DeepEP dispatch and
  combine kernel times and the expert grouped GEMMs, H800, EP 64, 4096 tokens per GPU, FP8 GEMMs and
  dispatch, BF16 combine: checks.

``--end-to-end`` sets the whole simulated step beside published end-to-end training runs
(``end_to_end.json``, :mod:`experiments.validation.end_to_end`): model / published per row and the median
and worst absolute error of the check rows, with the constants of ``experiments/conf`` (which hold the
fitted ones) and, where the file holds fitted constants, with those at 0 (before the fit).
``--end-to-end --fit`` first fits ``training.host_overhead_s`` to the calibration rows
(:mod:`experiments.validation.end_to_end_fit`) and stores it in the data file; the grids read the value
from ``experiments/conf/training/megatron.yaml`` (a test keeps the two equal).

``--extract-profile FILE`` re-extracts the profile's numbers from the Chrome trace and prints the JSON.
``--estimate-error`` prints how far the load-based DeepEP estimate (what per-sample counts allow) is from
exact per-token routes: the real traces under ``--traces`` (default ``../shared/traces``) and synthetic
routes (independent uniform top-k; DeepEP's node-limited benchmark router).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd

from experiments.validation.kernels import ROOT, estimate_error_table, extract_profile, validation_table

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validate", description=__doc__.splitlines()[0])
    ap.add_argument("--extract-profile", metavar="TRAIN_JSON", help="print the profile's numbers as JSON")
    ap.add_argument("--estimate-error", action="store_true", help="the DeepEP estimate against exact routes")
    ap.add_argument(
        "--end-to-end", action="store_true", help="the whole step against published training runs"
    )
    ap.add_argument(
        "--data",
        metavar="JSON",
        help="with --end-to-end: the rows to simulate (default experiments/data/end_to_end.json)",
    )
    ap.add_argument(
        "--write-tables",
        metavar="DIR",
        help="with --end-to-end: also write end_to_end.md / end_to_end_errors.md (and .tex) into DIR "
        "(docs/results: the tables docs/records/validation.md embeds; then python -m analysis --write-docs)",
    )
    ap.add_argument(
        "--moe-layer",
        action="store_true",
        help="one MoE layer's forward and backward against Megatron-LM's per-layer H100 measurements "
        "(experiments/data/moe_layer.json)",
    )
    ap.add_argument(
        "--penalty",
        action="store_true",
        help="what imbalance costs: dropless vs forced-balance runs (experiments/data/penalty.json), each "
        "routing source side by side, and the force-biased routing that would reproduce each row",
    )
    ap.add_argument(
        "--sources",
        default=None,
        help="with --penalty: comma-separated routing sources (popularity, force_biased:STD); default: "
        "experiments.validation.penalty.SOURCES",
    )
    ap.add_argument(
        "--fit",
        action="store_true",
        help="with --end-to-end: fit Blackwell's host overhead to the calibration rows; with --moe-layer: "
        "the isolated layer's post-sync host time; either stores it in the data file (fitted_constants)",
    )
    ap.add_argument(
        "--joint",
        action="store_true",
        help="with --moe-layer --fit: also print the diagnostic joint fit (GEMM efficiency and host time)",
    )
    default_traces = os.environ.get("RELIBRA_SHARED_TRACES", str(ROOT.parent.parent / "shared" / "traces"))
    ap.add_argument("--traces", default=default_traces, help="real traces (default ../shared/traces)")
    args = ap.parse_args(argv)
    if args.penalty:
        if args.end_to_end or args.moe_layer or args.fit or args.write_tables or args.joint:
            print("validate: --penalty goes with --data and --sources only", file=sys.stderr)
            return 2
        return _penalty(Path(args.data) if args.data else None, args.sources)
    if args.sources:
        print("validate: --sources goes with --penalty", file=sys.stderr)
        return 2
    if args.moe_layer:
        if args.end_to_end or args.write_tables:
            print("validate: --moe-layer goes with --fit, --joint and --data only", file=sys.stderr)
            return 2
        return _moe_layer(Path(args.data) if args.data else None, args.fit, args.joint)
    if args.joint:
        print("validate: --joint goes with --moe-layer --fit", file=sys.stderr)
        return 2
    if args.end_to_end:
        return _end_to_end(Path(args.data) if args.data else None, args.fit, args.write_tables)
    if args.fit or args.data or args.write_tables:
        print(
            "validate: --fit, --data and --write-tables go with --end-to-end (or --moe-layer)",
            file=sys.stderr,
        )
        return 2
    if args.estimate_error:
        err = estimate_error_table(Path(args.traces))
        print(err.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        return 0
    if args.extract_profile:
        if not Path(args.extract_profile).is_file():
            print(f"validate: --extract-profile {args.extract_profile}: no such file", file=sys.stderr)
            return 2
        print(json.dumps(extract_profile(args.extract_profile), indent=1))
        return 0
    table, fitted = validation_table()
    with pd.option_context("display.width", 200, "display.max_colwidth", 80, "display.max_rows", 200):
        print(table.drop(columns="source").to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(
        f"\nfitted achievable rates: RDMA {fitted['rdma'] / 1e9:.2f} GB/s per NIC (of 50), "
        f"NVLink (H800) {fitted['nvlink'] / 1e9:.1f} GB/s per direction (of 200)"
    )
    return 0


def _end_to_end(data: Path | None, fit: bool, write_tables: str | None) -> int:
    """``--end-to-end`` (module doc); exit status 2 with one message for a bad data file or row."""
    from experiments.validation.end_to_end import DATA_FILE, end_to_end_table

    path = data or DATA_FILE
    try:
        if fit:
            _fit_and_store(path)
        e2e = end_to_end_table(path)
    except ValueError as exc:  # ConfigError and the roles check: the file or a row named
        print(f"validate: {exc}", file=sys.stderr)
        return 2
    cols = ["id", "role", "parallelism", "published", "model", "ratio", "model_unfitted", "ratio_unfitted",
            "step_time_s", "t_compute_s", "t_comm_s", "t_attention_s", "t_other_s", "t_bubble_s",
            "t_launch_s", "needs"]  # fmt: skip
    with pd.option_context("display.width", 250, "display.max_colwidth", 60):
        print(e2e.reindex(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print()
    from experiments.validation.end_to_end_tables import end_to_end_tables

    fitted = e2e.attrs.get("fitted_constants")
    # NOTE: the check rows' errors as the generated end_to_end_errors table holds them (one definition).
    summary = end_to_end_tables(e2e, "python -m experiments.validate --end-to-end", fitted)[1]
    print(summary.title)
    print(summary.frame.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    if write_tables:
        from experiments.validation.end_to_end_tables import write_end_to_end_tables

        command = "python -m experiments.validate --end-to-end --write-tables " + write_tables
        if data:
            command += f" --data {data}"
        for out in write_end_to_end_tables(e2e, Path(write_tables), command, fitted):
            print(f"wrote {out}")
    return 0


def _fit_and_store(path: Path) -> None:
    """Fit ``training.host_overhead_s`` to the calibration rows of ``path``, print the fit and store it in
    the file's ``fitted_constants`` (written atomically; every other field kept)."""
    from experiments.validation.end_to_end import check_roles, load_rows
    from experiments.validation.end_to_end_fit import FITTED, fit_host_overhead
    from relibra.atomic import atomic_write

    doc = load_rows(path)
    fitted = fit_host_overhead(doc)
    print(
        f"{FITTED} = {fitted.value:.6g} s per MoE layer, direction and micro-batch ({len(fitted.rows)} rows)"
    )
    for rid, before, after, loo in zip(
        fitted.rows, fitted.ratios_before, fitted.ratios, fitted.leave_one_out, strict=True
    ):
        print(f"  {rid}: model / published {before:.3f} at 0 -> {after:.3f}; fitted without it {loo:.6g}")
    doc["fitted_constants"] = {**(doc.get("fitted_constants") or {}), FITTED: fitted.entry()}
    check_roles(doc)
    text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))
    print(f"stored in {path} (fitted_constants)")
    print(
        f"the grids run cluster.hardware.host_overhead_s of the Blackwell cluster yamls "
        f"(experiments/conf/cluster/b200.yaml, ...): set it to {fitted.value:.4g} there if it differs "
        "(tests/experiments/test_end_to_end_fit.py checks that they agree)\n"
    )


def _penalty(data: Path | None, sources: str | None) -> int:
    """``--penalty`` (:mod:`experiments.validation.penalty`); exit status 2 with one message for a bad file or
    source."""
    from experiments.config.errors import ConfigError
    from experiments.validation.penalty import (
        DATA_FILE,
        SOURCES,
        implied_std,
        load_penalty_rows,
        penalty_table,
    )

    path = data or DATA_FILE
    chosen = tuple(s.strip() for s in sources.split(",") if s.strip()) if sources is not None else SOURCES
    if not chosen:
        print("validate: --sources: no routing source given", file=sys.stderr)
        return 2
    try:
        table = penalty_table(path, chosen)
        rows = [r for r in load_penalty_rows(path)["rows"] if not r.get("needs")]
        implied = [{"id": r["id"], **implied_std(r)} for r in rows]
    except (ConfigError, KeyError, TypeError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"validate: penalty data {path}: {why}", file=sys.stderr)
        return 2
    cols = ["id", "source", "measured_penalty", "penalty", "penalty_ratio", "dropless_skew", "forced_step_s",
            "dropless_step_s", "needs"]  # fmt: skip
    with pd.option_context("display.width", 250):
        print(table.reindex(columns=cols).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        print("\nforce-biased routing that reproduces each measured penalty (std of the per-layer bias):")
        print(pd.DataFrame(implied).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for source, part in table[table.needs == ""].groupby("source", sort=False):
        err = (part.penalty_ratio - 1.0).abs()
        print(
            f"{source}: |simulated / measured penalty - 1| median {err.median():.1%}, worst {err.max():.1%}"
        )
    return 0


def _moe_layer(data: Path | None, fit: bool, joint: bool) -> int:
    """``--moe-layer`` (:mod:`experiments.validation.moe_layer`); exit status 2 with one message for a bad
    file."""
    from experiments.config.errors import ConfigError
    from experiments.validation.moe_layer import DATA_FILE, POST_SYNC, fit_layer, layer_table, load_layer_rows
    from relibra.atomic import atomic_write

    path = data or DATA_FILE
    try:
        doc = load_layer_rows(path)
        if fit:
            fitted = fit_layer(doc)
            print(f"{POST_SYNC} = {fitted.host_overhead_s:.6g} s per direction (the isolated layer's host "
                  f"time after the sync), at the yaml gemm_efficiency ({len(fitted.rows)} rows, "
                  f"log rms {fitted.log_rms:.3f})")  # fmt: skip
            if joint:
                both = fit_layer(doc, joint=True)
                print(f"diagnostic joint fit: gemm_efficiency {both.gemm_efficiency:.3f}, host "
                      f"{both.host_overhead_s:.6g} s (log rms {both.log_rms:.3f}); not adopted "
                      "(docs/validation.md)")  # fmt: skip
            doc["fitted_constants"] = fitted.entries()
            text = json.dumps(doc, indent=1, ensure_ascii=False) + "\n"
            atomic_write(path, lambda f: f.write(text.encode()))
            print(
                f"stored in {path} (fitted_constants); a property of the measurement's setup, not a "
                "cluster yaml's host_overhead_s (docs/validation.md, 'Calibration per GPU generation')\n"
            )
        table = layer_table(path)
    except (ConfigError, KeyError, TypeError) as exc:
        why = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"validate: per-layer data {path}: {why}", file=sys.stderr)
        return 2
    cols = ["id", "role", "forward_ms", "model_forward_ms", "backward_ms", "model_backward_ms", "ratio",
            "experts_ms", "shared_ms", "comm_ms", "permute_ms", "router_ms", "fp8_cast_ms",
            "host_ms"]  # fmt: skip
    with pd.option_context("display.width", 250):
        print(table[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for role in ("calibration", "check"):
        err = (table[table.role == role].ratio - 1.0).abs()
        print(f"{role} rows: |model / measured - 1| of forward + backward: median {err.median():.1%}, "
              f"worst {err.max():.1%} ({len(err)} rows)")  # fmt: skip
    return 0
