"""The paper's tables from a results frame, each with the paper's numbers beside ours and their ratio.

Input: the frame ``analysis.load.load_results`` returns (DESIGN.md result columns, one row per planner run,
plus ``experiment``). Rows that repeat a (model, dataset, planner, cluster) cell, e.g. several seeds or
batches, are averaged first.

Ratios ("ours / paper"):
- against a single paper number: ``ours / paper``;
- one of our numbers against a paper range ``[lo, hi]``: ``ours / clip(ours, lo, hi)``, so 1.00 means
  inside the paper's range, above 1 above it and below 1 below it;
- our range against the paper's range: low over low and high over high.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from analysis import paper

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

CELL = ["model", "dataset", "nodes", "gpus_per_node"]
"""Columns that name one grid point; planners are compared within it."""

MIB = 2.0**20

ONLINE_BASELINES = ("ultraep", "llep")
"""The strongest open balancers of 2026 (no paper range: ReLibra's paper predates them)."""

REPLAY_PLANNERS = ("relibra", "relibra_replicate_only", "relibra_portfolio", *ONLINE_BASELINES)
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


@dataclass(frozen=True)
class Table:
    """One reproduced table: a display-ready frame plus how to format its float columns."""

    name: str
    """File stem (``<name>.md``, ``<name>.tex``)."""
    title: str
    frame: pd.DataFrame
    formats: Mapping[str, str] = field(default_factory=dict)
    """Column -> format spec (``".2f"``); float columns not named use ``".2f"``."""
    note: str = ""

    def formatted(self) -> pd.DataFrame:
        """The frame with every float rendered as text (NaN as an en dash)."""
        out = self.frame.copy()
        for col in out.columns:
            if pd.api.types.is_float_dtype(out[col]):
                spec = self.formats.get(col, ".2f")
                out[col] = [("–" if pd.isna(v) else format(v, spec)) for v in out[col]]
            else:
                out[col] = out[col].astype(str)
        return out


def ep_size(frame: pd.DataFrame) -> pd.Series:
    """EP group size ``G = nodes * gpus_per_node`` of every row."""
    return (frame["nodes"] * frame["gpus_per_node"]).astype(int)


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


def overall_cells(frame: pd.DataFrame) -> Table:
    """ReLibra's throughput over every baseline, per (model, dataset, EP size); % of Balanced."""
    wide = _cells(frame, "throughput_tokens_per_s")
    if "relibra" not in wide:
        raise ValueError("overall table needs rows with planner == 'relibra'; none found in the results")
    out = wide[["model", "dataset"]].copy()
    out["EP"] = (wide["nodes"] * wide["gpus_per_node"]).astype(int)
    for base in (*paper.OVERALL_SPEEDUP, *ONLINE_BASELINES):
        if base in wide:
            out[f"over {paper.label(base)}"] = wide["relibra"] / wide[base]
    for bound, col in BOUND_COLUMNS.items():
        if bound in wide:
            out[col] = 100.0 * wide["relibra"] / wide[bound]
    return Table(
        "overall_cells",
        "ReLibra throughput speedup over each baseline, per model and dataset",
        out.sort_values(["model", "dataset"]).reset_index(drop=True),
        dict.fromkeys(BOUND_COLUMNS.values(), ".1f"),
    )


def overall_summary(frame: pd.DataFrame) -> Table:
    """Range of ReLibra's speedup over each baseline across the grid, beside the paper's range."""
    cells = overall_cells(frame).frame
    rows = []
    for base, (lo, hi) in paper.OVERALL_SPEEDUP.items():
        col = f"over {paper.label(base)}"
        if col not in cells:
            continue
        ours = cells[col].dropna()
        rows.append((f"over {paper.label(base)}", ours.min(), ours.max(), lo, hi))
    for base in ONLINE_BASELINES:  # no paper range
        col = f"over {paper.label(base)}"
        if col in cells:
            ours = cells[col].dropna()
            rows.append((col, ours.min(), ours.max(), float("nan"), float("nan")))
    for bound, col in BOUND_COLUMNS.items():
        if col in cells:
            frac = cells[col].dropna() / 100.0
            theirs = paper.FRACTION_OF_BALANCED if bound == "balanced" else (float("nan"), float("nan"))
            rows.append((f"of {paper.label(bound)}", frac.min(), frac.max(), *theirs))
    out = pd.DataFrame(rows, columns=["ReLibra", "ours lo", "ours hi", "paper lo", "paper hi"])
    out["ours/paper lo"] = out["ours lo"] / out["paper lo"]
    out["ours/paper hi"] = out["ours hi"] / out["paper hi"]
    return Table(
        "overall",
        "Overall training throughput: ReLibra over each baseline (x) and as a fraction of Balanced and of "
        "force-balanced",
        out,
    )


def ablation(frame: pd.DataFrame) -> Table:
    """Each ablation variant's throughput over Megatron-LM per dataset (geometric mean over models)."""
    wide = _cells(frame, "throughput_tokens_per_s")
    if "megatron" not in wide:
        raise ValueError("ablation table needs rows with planner == 'megatron' (the reference)")
    order = ("relibra_reorder_no_locality", "relibra_reorder_only", "relibra_replicate_only", "relibra")
    variants = [p for p in order if p in wide]
    rows = []
    for dataset, group in wide.groupby("dataset"):
        for var in variants:
            rel = (group[var] / group["megatron"]).dropna()
            ours = float(np.exp(np.log(rel).mean())) if len(rel) else float("nan")
            theirs = paper.ABLATION.get((var, str(dataset)), float("nan"))
            rows.append((paper.label(var), dataset, ours, theirs, ours / theirs))
    out = pd.DataFrame(rows, columns=["variant", "dataset", "ours (x Megatron-LM)", "paper", "ours/paper"])
    return Table("ablation", "Ablation: throughput relative to Megatron-LM", out)


def _skew_table(frame: pd.DataFrame, by: str, name: str, title: str, bounds: Mapping[str, tuple]) -> Table:
    data = frame.assign(EP=ep_size(frame))
    wide = data.groupby([by, "planner"])["skew_mean"].mean().unstack("planner").sort_index()
    out = pd.DataFrame({by: wide.index})
    for planner in wide.columns:
        out[f"{paper.label(planner)}"] = wide[planner].to_numpy()
        if planner in bounds:
            lo, hi = bounds[planner]
            out[f"{paper.label(planner)} paper"] = f"{lo:.2f}-{hi:.2f}"
            out[f"{paper.label(planner)} ours/paper"] = [range_ratio(v, lo, hi) for v in wide[planner]]
    return Table(name, title, out, dict.fromkeys(out.columns, ".3f"))


def _step_table(frame: pd.DataFrame, by: str, name: str, title: str) -> Table:
    data = frame.assign(EP=ep_size(frame))
    wide = data.groupby([by, "planner"])["step_time_s"].mean().unstack("planner").sort_index()
    if "relibra" not in wide.columns:
        raise ValueError("no relibra rows: the step table is relative to ReLibra")
    out = pd.DataFrame({by: wide.index, "ReLibra step s": wide["relibra"].to_numpy()})
    for planner in wide.columns.drop("relibra"):
        out[f"{paper.label(planner)} / ReLibra"] = (wide[planner] / wide["relibra"]).to_numpy()
    return Table(name, title, out, {"ReLibra step s": ".3f"} | {c: ".3f" for c in out.columns[2:]})


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


def overhead(frame: pd.DataFrame) -> Table:
    """ReLibra's overheads per model: replica buffer, planning time per batch, reordering share of a batch.

    Uses ``param_bytes_per_gpu`` and ``num_batches`` when the results carry them (NaN / per-run otherwise).
    """
    rows = frame[frame["planner"] == "relibra"]
    if rows.empty:
        raise ValueError("overhead table needs rows with planner == 'relibra'; none found in the results")
    cols = {
        "replica_buffer_bytes": "mean",
        "plan_time_s": "mean",
        "t_reorder_s": "mean",
        "step_time_s": "mean",
    }
    for extra in ("param_bytes_per_gpu", "num_batches"):
        if extra in rows:
            cols[extra] = "mean"
    agg = rows.groupby("model").agg(cols)
    out = pd.DataFrame({"model": agg.index})
    buf = agg["replica_buffer_bytes"].to_numpy() / MIB
    paper_mib = np.array([paper.REPLICA_BUFFER.get(m, (np.nan, np.nan))[0] for m in agg.index])
    paper_pct = np.array([paper.REPLICA_BUFFER.get(m, (np.nan, np.nan))[1] for m in agg.index])
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
    out["paper reorder %"] = f"{lo:.1f}-{hi:.1f}"
    out["reorder ours/paper"] = [range_ratio(v, lo, hi) for v in share]
    return Table(
        "overhead",
        "ReLibra overheads: replica buffer, planning time, reordering share of batch time",
        out,
        {"buffer MiB": ".1f", "paper MiB": ".1f", "plan s/batch": ".3f"},
    )


def replay_adds(frame: pd.DataFrame) -> Table:
    """What routing replay adds: ReLibra, its replication alone and its portfolio against UltraEP and LLEP
    per (model, dataset, EP size), the step time broken into its terms, and each planner's throughput over
    the faster of UltraEP and LLEP in the same cell."""
    data = frame[frame["planner"].isin(REPLAY_PLANNERS)]
    present = set(data["planner"])
    if not present & set(ONLINE_BASELINES) or not present - set(ONLINE_BASELINES):
        raise ValueError(
            "the routing-replay table needs rows of ultraep or llep and of relibra, relibra_replicate_only "
            f"or relibra_portfolio; found {sorted(present)}"
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
        "What routing replay adds: step time and its terms, against UltraEP and LLEP",
        out,
        {c: ".3f" for c in ["step s", *BREAKDOWN]} | {"x best online": ".3f"},
        "x best online: the faster of UltraEP and LLEP's step time over the row's (> 1: the row is faster). "
        "critical path s: planning between routing and expert compute; refill s: exposed replica copies "
        "(behind attention for ReLibra, after routing for UltraEP and LLEP); migration s: reordering.",
    )


def ultraep_headline(frame: pd.DataFrame) -> Table:
    """UltraEP's own headline beside ours: its throughput as a fraction of force-balanced and over
    Megatron-LM at EP 64 on Qwen3-235B-A22B and GLM4.5-106B-A12B (per dataset, and the mean)."""
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
    out["% of force-balanced"] = 100.0 * wide["ultraep"] / wide["force_balanced"]
    out["over Megatron-LM"] = wide["ultraep"] / wide["megatron"]
    if "balanced" in wide:
        out["% of Balanced"] = 100.0 * wide["ultraep"] / wide["balanced"]
    out = out.sort_values(["model", "dataset"]).reset_index(drop=True)
    mean = out.drop(columns=["model", "dataset"]).mean()
    out = pd.concat([out, pd.DataFrame([{"model": "mean", "dataset": "all", **mean}])], ignore_index=True)
    head = paper.ULTRAEP_HEADLINE
    out["paper %"] = 100.0 * head["of_force_balanced"]
    out["% ours/paper"] = out["% of force-balanced"] / out["paper %"]
    out["paper x"] = head["over_megatron"]
    out["x ours/paper"] = out["over Megatron-LM"] / out["paper x"]
    return Table(
        "ultraep_headline",
        "UltraEP's headline (EP 64): % of force-balanced and x Megatron-LM, ours beside its paper's",
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
    wide = data.pivot_table(index=keys, columns="planner", values="step_time_s", aggfunc="mean")
    planners = [p for p in ("megatron", "relibra", "balanced") if p in wide]
    planners += sorted(set(wide.columns) - set(planners))
    out = wide[planners].rename(columns=lambda p: f"{paper.label(p)} s").reset_index()
    out["ReLibra over Megatron-LM"] = (wide["megatron"] / wide["relibra"]).to_numpy()
    return Table(
        "comm_sensitivity",
        "Step time (s) by dispatcher and EP overlap, and ReLibra's speed-up over Megatron-LM",
        out,
        formats={c: ".3f" for c in out.columns if c.endswith(" s") or c.startswith("ReLibra over")},
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
        "overall": [overall_summary, overall_cells, replay_adds, ultraep_headline],
        "ablation": [ablation],
        "ep_scaling": [skew_by_ep, step_by_ep, replay_adds],
        "datasets": [skew_by_dataset, step_by_dataset, replay_adds],
        "overhead": [overhead],
        "real_trace": [overall_summary, overall_cells],
        "comm_sensitivity": [comm_sensitivity],
        "comm_sensitivity_overall": [comm_sensitivity],
        "whole_step_shift": [whole_step_shift],
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
