"""The paper's tables from a results frame, each with the paper's numbers beside ours and their ratio.

Input: the frame ``analysis.load.load_results`` returns (the result columns of docs/spine.md, one row
per planner run, plus ``experiment``). Rows that repeat a (model, dataset, planner, cluster) cell, e.g.
several seeds or batches, are averaged first.

Ratios ("ours / paper"):
- against a single paper number: ``ours / paper``;
- one of our numbers against a paper range ``[lo, hi]``: ``ours / clip(ours, lo, hi)``, so 1.00 means
  inside the paper's range, above 1 above it and below 1 below it;
- our range against the paper's range: low over low and high over high.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import pandas as pd

from analysis import paper
from analysis.peer import peer_table
from analysis.spread import SEED, add_spread, is_tie, per_seed, seed_note, summarise, with_seed
from analysis.table import Table

__all__ = [
    "Table",
    "ablation",
    "all_tables",
    "comm_sensitivity",
    "ep_size",
    "overall_cells",
    "overall_summary",
    "overhead",
    "range_ratio",
    "replay_adds",
    "skew_by_dataset",
    "skew_by_ep",
    "step_by_dataset",
    "step_by_ep",
    "ultraep_headline",
    "whole_step_shift",
]

CELL = ["model", "dataset", "nodes", "gpus_per_node", "nvl_domain"]
"""Columns that name one grid point; planners are compared within it."""

MIB = 2.0**20

ONLINE_BASELINES = ("ultraep", "llep", "moonep")
"""The strongest open balancers of 2026 that plan after routing (no paper range: ReLibra's paper predates
them)."""

REPLAY_BASED = ("relibra", "relibra_replicate_only", "relibra_portfolio", "foremoe")
"""Planners that plan from routing replay (oracle loads before the step)."""

REPLAY_PLANNERS = (*REPLAY_BASED, *ONLINE_BASELINES)
"""The planners of the "what routing replay adds" table, in its row order."""

BREAKDOWN = {
    "compute s": "t_compute_s",
    "comm s": "t_comm_s",
    "attention s": "t_attention_s",
    "critical path s": "t_critical_path_s",
    "refill s": "t_sync_exposed_s",
    "migration s": "t_reorder_s",
}
"""Step-time terms (result columns) of the "what routing replay adds" table."""

BOUND_COLUMNS = {"balanced": "% of Balanced", "force_balanced": "% of force-balanced"}
"""ReLibra's throughput as a percentage of each reference: the ideal bound and Megatron-LM's uniform-routing
ceiling, side by side."""


def ep_size(frame: pd.DataFrame) -> pd.Series:
    """EP group size ``G = nodes * gpus_per_node`` of every row."""
    return (frame["nodes"] * frame["gpus_per_node"]).astype(int)


def _domain_label(frame: pd.DataFrame) -> pd.Series:
    """``"<n> GPUs"`` per row: the GPUs of one NVLink domain (``nvl_domain``; rows stored before that column
    existed: their node)."""
    domain = frame["nvl_domain"] if "nvl_domain" in frame else pd.Series(np.nan, index=frame.index)
    domain = domain.fillna(frame["gpus_per_node"]).astype(int)
    return domain.map(lambda d: f"{d} GPUs")


def range_ratio(ours: float, lo: float, hi: float) -> float:
    """``ours / clip(ours, lo, hi)``: 1.0 inside the paper's range ``[lo, hi]``."""
    if np.isnan(ours):
        return float("nan")
    return float(ours / np.clip(ours, lo, hi))


def _cells(frame: pd.DataFrame, value: str) -> pd.DataFrame:
    """``value`` averaged per (cell, planner), pivoted to one column per planner."""
    keys = [c for c in CELL if c in frame.columns]
    means = frame.groupby([*keys, "planner"], dropna=False)[value].mean()
    return means.unstack("planner").reset_index()


RELIBRA_VARIANTS = ("relibra", "relibra_portfolio")
"""ReLibra's rows in the overall and overhead tables: the paper's algorithm (the reproduction) and the
recommended configuration (the incremental reordering's portfolio), labelled by
:func:`analysis.paper.label`."""

OVERALL_REFERENCES = (*paper.OVERALL_SPEEDUP, *ONLINE_BASELINES, "relibra_replicate_only")
"""What each ReLibra variant's throughput is divided by in the overall table (where present)."""


def overall_cells(frame: pd.DataFrame) -> Table:
    """Each ReLibra variant's throughput over every baseline, per (model, dataset, EP size); % of Balanced.

    One row per cell and variant (:data:`RELIBRA_VARIANTS` present in the results), labelled in ``ReLibra``.
    Ratios are per trace seed, summarised by their mean and min-max over seeds (:mod:`analysis.spread`).
    """
    keys = [c for c in CELL if c in frame.columns]
    wide = per_seed(frame, keys, "throughput_tokens_per_s")
    variants = [v for v in RELIBRA_VARIANTS if v in wide]
    if "relibra" not in variants:
        raise ValueError("overall table needs rows with planner == 'relibra'; none found in the results")
    index = wide.index.droplevel("seed").unique()
    parts = []
    spread: dict[str, tuple[str, str]] = {}
    ties: set[str] = set()
    for rank, variant in enumerate(variants):
        cols: dict[str, pd.Series] = {}
        for base in OVERALL_REFERENCES:
            if base in wide:
                name = f"over {paper.label(base)}"
                add_spread(cols, spread, name, wide[variant] / wide[base], keys)
                ties.add(name)
        for bound, col in BOUND_COLUMNS.items():
            if bound in wide:
                add_spread(cols, spread, col, wide[variant] / wide[bound], keys, 100.0)
        ratios = pd.DataFrame(cols).reindex(index).reset_index()
        out = ratios[["model", "dataset"]].copy()
        out["EP"] = (ratios["nodes"] * ratios["gpus_per_node"]).astype(int)
        out.insert(0, "ReLibra", paper.label(variant))
        out["rank"] = rank
        out = pd.concat([out, ratios[list(cols)]], axis=1)
        parts.append(out)
    cells = pd.concat(parts, ignore_index=True).sort_values(["model", "dataset", "EP", "rank"])
    return Table(
        "overall_cells",
        "ReLibra throughput speedup over each baseline, per model and dataset: the paper's algorithm and the "
        "recommended configuration",
        cells.drop(columns="rank").reset_index(drop=True),
        dict.fromkeys(BOUND_COLUMNS.values(), ".1f"),
        seed_note(frame),
        spread=spread,
        ties=frozenset(ties),
    )


def overall_summary(frame: pd.DataFrame) -> Table:
    """Range of each ReLibra variant's speedup over each baseline across the grid, beside the paper's, and
    how many cells are ties over the trace seeds (:mod:`analysis.spread`)."""
    table = overall_cells(frame)
    cells = table.frame
    rows = []
    for variant, group in cells.groupby("ReLibra", sort=False):
        for base in OVERALL_REFERENCES:
            col = f"over {paper.label(base)}"
            if col in group:
                ours = group[col].dropna()
                lo, hi = paper.OVERALL_SPEEDUP.get(base, (float("nan"), float("nan")))
                low, high = group[f"{col} min"], group[f"{col} max"]
                tied = sum(is_tie(a, b, 2) for a, b in zip(low, high, strict=True) if a < b)
                rows.append((variant, col, ours.min(), ours.max(), lo, hi, f"{tied} of {len(ours)}"))
        for bound, col in BOUND_COLUMNS.items():
            if col in group:
                frac = group[col].dropna() / 100.0
                theirs = paper.FRACTION_OF_BALANCED if bound == "balanced" else (float("nan"), float("nan"))
                rows.append((variant, f"of {paper.label(bound)}", frac.min(), frac.max(), *theirs, "–"))
    columns = ["ReLibra", "against", "ours lo", "ours hi", "paper lo", "paper hi", "cells tied"]
    out = pd.DataFrame(rows, columns=columns)
    out.insert(6, "ours/paper lo", out["ours lo"] / out["paper lo"])
    out.insert(7, "ours/paper hi", out["ours hi"] / out["paper hi"])
    balanced = out["against"] == f"of {paper.label('balanced')}"  # NOTE: not the paper's Balanced: no ratio
    out.loc[balanced, ["ours/paper lo", "ours/paper hi"]] = np.nan
    return Table(
        "overall",
        "Overall training throughput: ReLibra (the paper's algorithm and the recommended configuration) over "
        "each baseline (x) and as a fraction of Balanced and of force-balanced",
        out,
        note="ours lo / hi: the lowest and highest cell of the grid (each cell's mean over trace seeds); "
        "cells tied: cells whose ratio's min-max over seeds contains 1. paper lo / hi: the paper's range "
        "for its ReLibra, set beside both variants. of Balanced: no ours/paper, since Balanced here is a "
        "true bound (only unavoidable traffic) and the paper's was not, so the two are not comparable. "
        f"{seed_note(frame)}",
    )


def ablation(frame: pd.DataFrame) -> Table:
    """Each ablation variant's throughput over Megatron-LM per dataset (geometric mean over models)."""
    wide = per_seed(frame, CELL, "throughput_tokens_per_s")
    if "megatron" not in wide:
        raise ValueError("ablation table needs rows with planner == 'megatron' (the reference)")
    order = ("relibra_reorder_no_locality", "relibra_reorder_only", "relibra_replicate_only", "relibra")
    variants = [p for p in order if p in wide]
    rows = []
    for var in variants:  # NOTE: the geometric mean over models is taken per seed, then spread over seeds
        log_rel = np.log(wide[var] / wide["megatron"]).dropna()
        per_seed_mean = np.exp(log_rel.groupby(level=["dataset", "seed"]).mean())
        for dataset, stats in summarise(per_seed_mean, ["dataset"]).iterrows():
            theirs = paper.ABLATION.get((var, str(dataset)), float("nan"))
            ours = float(stats["mean"])
            rows.append((paper.label(var), dataset, ours, stats["min"], stats["max"], theirs, ours / theirs))
    ours_col = "ours (x Megatron-LM)"
    columns = ["variant", "dataset", ours_col, "min", "max", "paper", "ours/paper"]
    out = pd.DataFrame(rows, columns=columns).sort_values("dataset", kind="stable").reset_index(drop=True)
    return Table(
        "ablation",
        "Ablation: throughput relative to Megatron-LM",
        out,
        note=f"Geometric mean over the models. {seed_note(frame)}",
        spread={ours_col: ("min", "max")},
        ties=frozenset({ours_col}),
    )


def _skew_table(frame: pd.DataFrame, by: str, name: str, title: str, bounds: Mapping[str, tuple]) -> Table:
    """Skewness per ``by`` and planner over seeds (mean, min-max), with the paper's range where it has one."""
    wide = per_seed(frame.assign(EP=ep_size(frame)), [by], "skew_mean").sort_index()
    cols: dict[str, pd.Series] = {}
    spread: dict[str, tuple[str, str]] = {}
    for planner in wide.columns:
        label = paper.label(planner)
        add_spread(cols, spread, label, wide[planner], [by])
        if planner in bounds:
            lo, hi = bounds[planner]
            cols[f"{label} paper"] = pd.Series(f"{lo:.2f}-{hi:.2f}", index=cols[label].index)
            cols[f"{label} ours/paper"] = cols[label].map(lambda v, lo=lo, hi=hi: range_ratio(v, lo, hi))
    out = pd.DataFrame(cols).rename_axis(by).reset_index()
    return Table(name, title, out, dict.fromkeys(out.columns, ".3f"), seed_note(frame), spread=spread)


def _step_table(frame: pd.DataFrame, by: str, name: str, title: str) -> Table:
    wide = per_seed(frame.assign(EP=ep_size(frame)), [by], "step_time_s").sort_index()
    if "relibra" not in wide.columns:
        raise ValueError("no relibra rows: the step table is relative to ReLibra")
    cols: dict[str, pd.Series] = {"ReLibra step s": summarise(wide["relibra"], [by])["mean"]}
    spread: dict[str, tuple[str, str]] = {}
    for planner in wide.columns.drop("relibra"):
        add_spread(cols, spread, f"{paper.label(planner)} / ReLibra", wide[planner] / wide["relibra"], [by])
    out = pd.DataFrame(cols).rename_axis(by).reset_index()
    return Table(
        name,
        title,
        out,
        {c: ".3f" for c in out.columns[1:]},
        seed_note(frame),
        spread=spread,
        ties=frozenset(spread),
    )


def step_by_ep(frame: pd.DataFrame) -> Table:
    """Mean step time of ReLibra per EP size, and every other planner's relative to it (< 1: faster)."""
    return _step_table(frame, "EP", "step_by_ep", "Step time by EP size, relative to ReLibra")


def step_by_dataset(frame: pd.DataFrame) -> Table:
    """Mean step time of ReLibra per dataset, and every other planner's relative to it (< 1: faster)."""
    return _step_table(frame, "dataset", "step_by_dataset", "Step time by dataset, relative to ReLibra")


def skew_by_ep(frame: pd.DataFrame) -> Table:
    """Mean skewness per EP size and planner (the paper: Qwen3-30B-A3B, EP 8-64)."""
    return _skew_table(
        frame, "EP", "skew_by_ep", "Skewness (max/mean GPU tokens) by EP size", paper.SKEW_BY_EP
    )


def skew_by_dataset(frame: pd.DataFrame) -> Table:
    """Mean skewness per dataset and planner (the paper: Qwen3-235B-A22B)."""
    return _skew_table(
        frame,
        "dataset",
        "skew_by_dataset",
        "Skewness (max/mean GPU tokens) by dataset",
        paper.SKEW_BY_DATASET,
    )


MOVE_COLUMNS = {
    "moved pairs/batch": "reorder_moved_experts",
    "moved GB/batch": "migration_bytes",
    "layers kept %": "layers_kept_share",
    "least-kept layer %": "layers_kept_share_min",
}
"""The moves of the overhead table (result columns, per batch): moved (layer, expert) pairs, the bytes sent
between GPUs, the share of (batch, layer) pairs whose placement was kept and that share for the layer that
kept its placement least often."""


def overhead(frame: pd.DataFrame) -> Table:
    """ReLibra's overheads per model and variant (:data:`RELIBRA_VARIANTS`): replica buffer, planning time per
    batch, reordering share of a batch (mean over the cells, and its median and range over cells), moves.

    Uses ``param_bytes_per_gpu`` and ``num_batches`` when the results carry them (NaN / per-run otherwise);
    the move columns are NaN for cells stored before they existed.
    """
    rows = frame[frame["planner"].isin(RELIBRA_VARIANTS)]
    if not (rows["planner"] == "relibra").any():
        raise ValueError("overhead table needs rows with planner == 'relibra'; none found in the results")
    rows = rows.assign(share=100.0 * rows["t_reorder_s"] / rows["step_time_s"])
    for col in MOVE_COLUMNS.values():  # NOTE: cells stored before a column existed lack it
        if col not in rows:
            rows = rows.assign(**{col: np.nan})
    cols = {
        "replica_buffer_bytes": "mean",
        "plan_time_s": "mean",
        "t_reorder_s": "mean",
        "step_time_s": "mean",
        **dict.fromkeys(MOVE_COLUMNS.values(), "mean"),
    }
    for extra in ("param_bytes_per_gpu", "num_batches"):
        if extra in rows:
            cols[extra] = "mean"
    rank = {v: i for i, v in enumerate(RELIBRA_VARIANTS)}
    agg = rows.groupby(["model", "planner"]).agg(cols)
    spread = rows.groupby(["model", "planner"])["share"].agg(["median", "min", "max"])
    by_seed = with_seed(rows).groupby(["model", "planner", SEED])[["t_reorder_s", "step_time_s"]].mean()
    seed_share = summarise(100.0 * by_seed["t_reorder_s"] / by_seed["step_time_s"], ["model", "planner"])
    order = sorted(agg.index, key=lambda key: (key[0], rank[key[1]]))
    agg, spread, seed_share = agg.loc[order], spread.loc[order], seed_share.reindex(order)
    models = [m for m, _ in order]
    out = pd.DataFrame({"model": models, "ReLibra": [paper.label(p) for _, p in order]})
    buf = agg["replica_buffer_bytes"].to_numpy() / MIB
    paper_mib = np.array([paper.REPLICA_BUFFER.get(m, (np.nan, np.nan))[0] for m in models])
    paper_pct = np.array([paper.REPLICA_BUFFER.get(m, (np.nan, np.nan))[1] for m in models])
    out["buffer MiB"] = buf
    out["paper MiB"] = paper_mib
    out["MiB ours/paper"] = buf / paper_mib
    params = (
        agg["param_bytes_per_gpu"].to_numpy() if "param_bytes_per_gpu" in agg else np.full(len(agg), np.nan)
    )
    pct = 100.0 * agg["replica_buffer_bytes"].to_numpy() / params
    out["buffer % params"] = pct
    out["paper %"] = paper_pct
    out["% ours/paper"] = pct / paper_pct
    batches = agg["num_batches"].to_numpy() if "num_batches" in agg else np.ones(len(agg))
    out["plan s/batch"] = agg["plan_time_s"].to_numpy() / batches
    share = 100.0 * agg["t_reorder_s"].to_numpy() / agg["step_time_s"].to_numpy()
    lo, hi = paper.REORDER_OVERHEAD_PCT
    out["reorder % batch"] = share
    out["reorder % batch min"] = seed_share["min"].to_numpy()
    out["reorder % batch max"] = seed_share["max"].to_numpy()
    out["reorder % median cell"] = spread["median"].to_numpy()
    out["reorder % cells"] = [f"{a:.2f}-{b:.2f}" for a, b in zip(spread["min"], spread["max"], strict=True)]
    out["paper reorder %"] = f"{lo:.1f}-{hi:.1f}"
    out["reorder ours/paper"] = [range_ratio(v, lo, hi) for v in share]
    for label, col in MOVE_COLUMNS.items():
        values = agg[col].to_numpy(dtype=np.float64)
        out[label] = values / 1e9 if col == "migration_bytes" else 100.0 * values if "kept" in col else values
    return Table(
        "overhead",
        "ReLibra overheads: replica buffer, planning time, reordering share of batch time, moves per batch",
        out,
        {
            "buffer MiB": ".1f",
            "paper MiB": ".1f",
            "plan s/batch": ".3f",
            "moved pairs/batch": ".0f",
            "moved GB/batch": ".1f",
            "layers kept %": ".1f",
            "least-kept layer %": ".1f",
        },
        "reorder % batch: mean migration over mean step of the model's cells (min-max of that share over "
        "the trace seeds beside it); median cell and cells: the per-cell shares. Moves are per batch (the "
        "first batch moves from Megatron-LM's static placement). " + seed_note(frame),
        spread={"reorder % batch": ("reorder % batch min", "reorder % batch max")},
    )


def replay_adds(frame: pd.DataFrame) -> Table:
    """What routing replay adds: ReLibra, its replication alone, its portfolio and ForeMoE (the replay-based
    planners) against UltraEP, LLEP and MoonEP (the online ones) per (model, dataset, EP size), the step time
    broken into its terms, and each planner's throughput over the fastest online planner in the same cell."""
    data = frame[frame["planner"].isin(REPLAY_PLANNERS)]
    present = set(data["planner"])
    if not present & set(ONLINE_BASELINES) or not present - set(ONLINE_BASELINES):
        raise ValueError(
            f"the routing-replay table needs rows of one of {list(ONLINE_BASELINES)} and of one of "
            f"{list(REPLAY_BASED)}; found {sorted(present)}"
        )
    data = data.assign(EP=ep_size(data))
    for col in BREAKDOWN.values():  # NOTE: cells stored before a term existed lack its column
        if col not in data:
            data[col] = np.nan
    keys = ["model", "dataset", "EP"]
    means = data.groupby([*keys, "planner"], as_index=False)[["step_time_s", *BREAKDOWN.values()]].mean()
    online = means[means["planner"].isin(ONLINE_BASELINES)].groupby(keys)["step_time_s"].min()
    best = online.reindex(pd.MultiIndex.from_frame(means[keys])).to_numpy()
    means["x best online"] = best / means["step_time_s"]
    means["rank"] = means["planner"].map({p: i for i, p in enumerate(REPLAY_PLANNERS)})
    means = means.sort_values([*keys, "rank"]).reset_index(drop=True)
    out = means[keys].copy()
    out["planner"] = means["planner"].map(paper.label)
    out["step s"] = means["step_time_s"]
    for label, col in BREAKDOWN.items():
        out[label] = means[col]
    out["x best online"] = means["x best online"]
    return Table(
        "replay_adds",
        "What routing replay adds: step time and its terms, against UltraEP, LLEP and MoonEP",
        out,
        {c: ".3f" for c in ["step s", *BREAKDOWN]} | {"x best online": ".3f"},
        "x best online: the fastest of UltraEP, LLEP and MoonEP's step time over the row's (> 1: the row is "
        "faster). critical path s: planning between routing and expert compute; refill s: exposed replica "
        "copies (behind attention for ReLibra, after routing for UltraEP, LLEP and MoonEP); migration s: "
        "reordering.",
    )


def ultraep_headline(frame: pd.DataFrame) -> Table:
    """UltraEP's own headline beside ours: its throughput as a fraction of force-balanced and over
    Megatron-LM at EP 64 on Qwen3-235B-A22B and GLM4.5-106B-A12B (per dataset, and the mean per NVLink
    domain size: 8-GPU Hopper nodes, and one domain holding the whole group, UltraEP's own setting)."""
    data = frame[frame["model"].isin(paper.ULTRAEP_HEADLINE_MODELS) & (ep_size(frame) == 64)]
    wide = _cells(data, "throughput_tokens_per_s")
    missing = [p for p in ("ultraep", "megatron", "force_balanced") if p not in wide]
    if missing:
        raise ValueError(
            f"the UltraEP headline table needs rows of {missing} for "
            f"{list(paper.ULTRAEP_HEADLINE_MODELS)} at EP 64 (run overall with "
            "planner=megatron,ultraep,force_balanced; docs/baselines.md)"
        )
    out = wide[["model", "dataset"]].copy()
    out.insert(0, "NVLink domain", _domain_label(wide))
    out["% of force-balanced"] = 100.0 * wide["ultraep"] / wide["force_balanced"]
    out["over Megatron-LM"] = wide["ultraep"] / wide["megatron"]
    if "balanced" in wide:
        out["% of Balanced"] = 100.0 * wide["ultraep"] / wide["balanced"]
    out = out.sort_values(["NVLink domain", "model", "dataset"]).reset_index(drop=True)
    means = [
        {"NVLink domain": dom, "model": "mean", "dataset": "all", **rows.drop(columns=[*keys]).mean()}
        for dom, rows in out.groupby("NVLink domain", sort=True)
        for keys in [["NVLink domain", "model", "dataset"]]
    ]
    out = pd.concat([out, pd.DataFrame(means)], ignore_index=True)
    head = paper.ULTRAEP_HEADLINE
    out["paper %"] = 100.0 * head["of_force_balanced"]
    out["% ours/paper"] = out["% of force-balanced"] / out["paper %"]
    out["paper x"] = head["over_megatron"]
    out["x ours/paper"] = out["over Megatron-LM"] / out["paper x"]
    return Table(
        "ultraep_headline",
        "UltraEP's headline (EP 64): % of force-balanced and x Megatron-LM, ours beside its paper's, per "
        "NVLink domain",
        out,
        {"% of force-balanced": ".1f", "% of Balanced": ".1f", "paper %": ".1f"},
    )


def comm_sensitivity(frame: pd.DataFrame) -> Table:
    """Step time of every planner per (model, dataset, EP) under each dispatcher and overlap setting, and
    ReLibra's speed-up over Megatron-LM, so a reader sees how the ranking moves with the communication model.
    """
    needed = {"dispatcher", "ep_overlap", "planner", "step_time_s"}
    if not needed <= set(frame.columns):
        raise ValueError(f"communication sensitivity needs the columns {sorted(needed)}")
    if not {"megatron", "relibra"} <= set(frame["planner"]):
        raise ValueError("communication sensitivity needs rows of planners megatron and relibra")
    data = frame.assign(EP=ep_size(frame), overlap=frame["ep_overlap"].map({True: "on", False: "off"}))
    keys = ["model", "dataset", "EP", "dispatcher", "overlap"]
    wide = per_seed(data, keys, "step_time_s")
    planners = [p for p in ("megatron", "relibra", "balanced") if p in wide]
    planners += sorted(set(wide.columns) - set(planners))
    cols: dict[str, pd.Series] = {f"{paper.label(p)} s": summarise(wide[p], keys)["mean"] for p in planners}
    spread: dict[str, tuple[str, str]] = {}
    add_spread(cols, spread, "ReLibra over Megatron-LM", wide["megatron"] / wide["relibra"], keys)
    if "relibra_portfolio" in wide:
        ours = wide["relibra_portfolio"]
        add_spread(cols, spread, "recommended over Megatron-LM", wide["megatron"] / ours, keys)
        if "relibra_replicate_only" in wide:
            add_spread(
                cols, spread, "recommended over replication only", wide["relibra_replicate_only"] / ours, keys
            )
    out = pd.DataFrame(cols).reset_index()
    return Table(
        "comm_sensitivity",
        "Step time (s) by dispatcher and EP overlap, and ReLibra's speed-up over Megatron-LM",
        out,
        formats={c: ".3f" for c in out.columns if c.endswith(" s") or " over " in c},
        note=seed_note(frame),
        spread=spread,
        ties=frozenset(spread),
    )


SHIFT_BASELINES = ("megatron", "eplb", "ultraep", "llep")
"""The headline ratios whose move from the MoE-only to the whole step the shift table shows."""


def whole_step_shift(frame: pd.DataFrame) -> Table:
    """How each headline ratio moves from the MoE-only step to the whole step: per (model, dataset, EP),
    ReLibra's throughput over Megatron-LM, EPLB+, UltraEP and LLEP and as a % of force-balanced, under
    ``simulator.step=moe`` and ``whole``, and their ratio (whole / moe); a last row holds the medians."""
    if "step" not in frame or not {"moe", "whole"} <= set(frame["step"]):
        raise ValueError("the whole-step shift table needs cells of both simulator.step=moe and whole")
    if "relibra" not in set(frame["planner"]):
        raise ValueError("the whole-step shift table needs rows of planner relibra")
    data = frame.assign(EP=ep_size(frame))
    wide = data.pivot_table(
        index=["model", "dataset", "EP", "step"],
        columns="planner",
        values="throughput_tokens_per_s",
        aggfunc="mean",
    )
    ratios = pd.DataFrame(index=wide.index)
    for base in SHIFT_BASELINES:
        if base in wide:
            ratios[f"over {paper.label(base)}"] = wide["relibra"] / wide[base]
    if "force_balanced" in wide:
        ratios["% of force-balanced"] = 100.0 * wide["relibra"] / wide["force_balanced"]
    by_step = ratios.unstack("step")
    out = pd.DataFrame(index=by_step.index)
    for col in ratios.columns:
        out[f"{col} moe"] = by_step[(col, "moe")]
        out[f"{col} whole"] = by_step[(col, "whole")]
        out[f"{col} whole/moe"] = by_step[(col, "whole")] / by_step[(col, "moe")]
    out = out.reset_index()
    median = out.drop(columns=["model", "dataset", "EP"]).median()
    out = pd.concat(
        [out, pd.DataFrame([{"model": "median", "dataset": "all", "EP": 0, **median}])], ignore_index=True
    )
    return Table(
        "whole_step_shift",
        "Headline ratios on the MoE-only step and on the whole step (ReLibra over each baseline, x; % of "
        "force-balanced)",
        out,
        {c: ".3f" for c in out.columns if c.endswith("whole/moe")}
        | {c: ".1f" for c in out.columns if c.startswith("%") and not c.endswith("whole/moe")},
        note="whole/moe: the ratio on the whole step over the same ratio on the MoE-only step.",
    )


def all_tables(by_experiment: Mapping[str, pd.DataFrame]) -> tuple[list[Table], list[str]]:
    """Every table the present experiments allow, and why any other was skipped.

    ``by_experiment``: ``{experiment name: frame}`` (``quick_`` variants map to their preset's tables).
    Table names become ``<experiment>.<table>`` and titles end with the experiment, so a full preset and
    its quick variant never overwrite each other.
    """
    builders = {
        "overall": [overall_summary, overall_cells, replay_adds, ultraep_headline, overhead],
        "overall_deepep": [overall_summary, overall_cells, replay_adds],
        "ablation": [ablation],
        "ep_scaling": [skew_by_ep, step_by_ep, replay_adds],
        "nvl72": [skew_by_ep, step_by_ep, replay_adds, ultraep_headline],
        "datasets": [skew_by_dataset, step_by_dataset, replay_adds],
        "overhead": [overhead],
        "real_trace": [overall_summary, overall_cells],
        "comm_sensitivity": [comm_sensitivity],
        "comm_sensitivity_overall": [comm_sensitivity],
        "whole_step_shift": [whole_step_shift],
        "peer": [peer_table],
    }
    tables: list[Table] = []
    skipped: list[str] = []
    for experiment, frame in by_experiment.items():
        if experiment.removeprefix("quick_") not in builders:
            skipped.append(
                f"{experiment}: no tables: not a known experiment (its cells' experiment_name, else its "
                f"folder name, should be one of {sorted(builders)}, optionally with quick_)"
            )
            continue
        for build in builders[experiment.removeprefix("quick_")]:
            try:
                table = build(frame)
            except (ValueError, KeyError) as exc:  # NOTE: a partial grid must not cost the other tables
                skipped.append(f"{experiment}: {build.__name__} skipped: {exc}")
                continue
            if table.frame.empty:
                planners = sorted(frame["planner"].unique()) if "planner" in frame else []
                skipped.append(
                    f"{experiment}: {build.__name__} skipped: no rows to compare (planners: {planners})"
                )
                continue
            tables.append(
                replace(table, name=f"{experiment}.{table.name}", title=f"{table.title} [{experiment}]")
            )
    return tables, skipped
