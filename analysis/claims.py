"""The ``paper_claims`` table: each claim of the paper (:mod:`analysis.paper`), our value with its spread, a
verdict by one written rule, and the measured cause of a difference read from the cost breakdown columns.

Verdict rule (:data:`RULE`, printed under the table):

- a claim given as a range ``[lo, hi]`` (over the paper's models and datasets) is *reproduced* when the
  range of our grid points' means (cells, EP sizes or datasets; each a mean over trace seeds) lies inside
  ``[lo * (1 - TOL), hi * (1 + TOL)]``, *not reproduced* otherwise;
- a claim given as one number is *reproduced* when our mean is within ``TOL`` of it (relative);
- *not comparable* when the quantity is defined differently here (Balanced is a true bound here, the
  paper's was not) or the setup does not model it (the post-rollout window that hides planning).

``TOL`` is 5 %: the size of the differences between one-seed runs of the same cell that issue 31 measured
(the quick and paper-scale runs of a cell differed by up to 0.07 in ratios of 1.0-1.6), so a smaller gap
is not told apart from seed noise without more seeds.

The cause column is the difference of each step-time term (:data:`analysis.tables.BREAKDOWN`) between
ReLibra's rows and the reference's in the same cells and seeds, mean over them; the two largest in size.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from analysis import paper
from analysis.spread import per_seed, summarise, with_seed
from analysis.tables import BREAKDOWN, CELL, MIB, Table, ep_size

__all__ = ["RULE", "TOL", "paper_claims"]

TOL = 0.05
"""Relative tolerance of the verdict (module docstring: the one-seed noise issue 31 measured)."""

RULE = (
    "Verdict: a paper range [lo, hi] is reproduced when our grid points' means all lie in "
    f"[lo x {1 - TOL:.2f}, hi x {1 + TOL:.2f}]; a single paper number when our mean is within {TOL:.0%} "
    "of it; "
    "not comparable when the quantity is defined differently here or not modelled. ours: the mean, or the "
    "range of grid-point means; spread: min-max over every cell and trace seed. cause: ReLibra's step-time "
    "terms minus the reference's, mean over the same cells and seeds (the two largest)."
)

NOT_THE_PAPERS_BALANCED = "Balanced here is a true bound (only unavoidable traffic), not the paper's Balanced"
NO_TIME_TERM = "buffer = r x 3 x hidden x moe_ffn x 2 bytes (docs/replicate.md); no time term"
NOT_MODELLED = "the post-rollout window is not modelled; planning on the critical path"

COLUMNS = ["claim", "source", "paper", "ours", "spread", "verdict", "cause"]


def _pick(by: Mapping[str, pd.DataFrame], preset: str) -> tuple[str, pd.DataFrame] | None:
    """The paper-scale preset's frame, else its quick variant's (None when neither ran)."""
    for name in (preset, f"quick_{preset}"):
        frame = by.get(name)
        if frame is not None and not frame.empty:
            return name, frame
    return None


def _range_verdict(values: pd.Series, lo: float, hi: float) -> str:
    values = values.dropna()
    if values.empty:
        return "not comparable"
    inside = values.min() >= lo * (1 - TOL) and values.max() <= hi * (1 + TOL)
    return "reproduced" if inside else "not reproduced"


def _single_verdict(ours: float, theirs: float) -> str:
    if np.isnan(ours) or np.isnan(theirs):
        return "not comparable"
    return "reproduced" if abs(ours / theirs - 1.0) <= TOL else "not reproduced"


def _span(values: pd.Series, spec: str = ".2f") -> str:
    values = values.dropna()
    if values.empty:
        return "–"
    lo, hi = format(values.min(), spec), format(values.max(), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def _cause(frame: pd.DataFrame, ours: str, ref: str) -> str:
    """The two largest mean differences of step-time terms, ``ours`` minus ``ref``, in the same cells."""
    terms = {label: col for label, col in BREAKDOWN.items() if col in frame}
    if not terms or ours not in set(frame["planner"]) or ref not in set(frame["planner"]):
        return "–"
    diffs = {}
    for label, col in terms.items():
        wide = per_seed(frame, CELL, col)
        diffs[label] = float((wide[ours] - wide[ref]).mean())
    step = per_seed(frame, CELL, "step_time_s")
    total = float((step[ours] - step[ref]).mean())
    top = sorted(diffs.items(), key=lambda kv: -abs(kv[1]))[:2]
    parts = ", ".join(f"{label} {value:+.3f}" for label, value in top)
    return f"{paper.label(ours)} - {paper.label(ref)}: step {total:+.3f} s; {parts}"


def _overall_rows(name: str, frame: pd.DataFrame) -> list[tuple[str, ...]]:
    keys = [c for c in CELL if c in frame.columns]
    wide = per_seed(frame, keys, "throughput_tokens_per_s")
    rows: list[tuple[str, ...]] = []
    if "relibra" not in wide:
        return rows
    for base, (lo, hi) in paper.OVERALL_SPEEDUP.items():
        if base not in wide:
            continue
        ratio = wide["relibra"] / wide[base]
        means = summarise(ratio, keys)["mean"]
        verdict = _range_verdict(means, lo, hi)
        cause = _cause(frame, "relibra", base) if verdict != "reproduced" else "–"
        rows.append(
            (
                f"ReLibra over {paper.label(base)} (x)",
                f"{name}.overall",
                f"{lo:.2f}-{hi:.2f}",
                _span(means),
                _span(ratio),
                verdict,
                cause,
            )
        )
    if "balanced" in wide:
        lo, hi = paper.FRACTION_OF_BALANCED
        frac = wide["relibra"] / wide["balanced"]
        rows.append(
            (
                "ReLibra as a fraction of Balanced",
                f"{name}.overall",
                f"{lo:.2f}-{hi:.2f}",
                _span(summarise(frac, keys)["mean"]),
                _span(frac),
                "not comparable",
                NOT_THE_PAPERS_BALANCED,
            )
        )
    return rows


def _ablation_rows(name: str, frame: pd.DataFrame) -> list[tuple[str, ...]]:
    wide = per_seed(frame, CELL, "throughput_tokens_per_s")
    rows: list[tuple[str, ...]] = []
    if "megatron" not in wide:
        return rows
    for (variant, dataset), theirs in paper.ABLATION.items():
        if variant not in wide:
            continue
        log_rel = np.log(wide[variant] / wide["megatron"]).dropna()
        rel = log_rel[log_rel.index.get_level_values("dataset") == dataset]
        if rel.empty:
            continue
        by_seed = np.exp(rel.groupby(level="seed").mean())
        ours = float(by_seed.mean())
        verdict = _single_verdict(ours, theirs)
        data = frame[frame["dataset"] == dataset]
        cause = _cause(data, variant, "megatron") if verdict != "reproduced" else "–"
        rows.append(
            (
                f"ablation: {paper.label(variant)}, {dataset} (x Megatron-LM)",
                f"{name}.ablation",
                f"{theirs:.2f}",
                f"{ours:.2f}",
                _span(by_seed),
                verdict,
                cause,
            )
        )
    return rows


def _skew_rows(
    name: str, frame: pd.DataFrame, by: str, bounds: tuple[float, float], what: str
) -> tuple[str, ...]:
    rows = with_seed(frame[frame["planner"] == "relibra"].assign(EP=ep_size(frame)))
    means = rows.groupby(by)["skew_mean"].mean()
    lo, hi = bounds
    table = "skew_by_ep" if by == "EP" else "skew_by_dataset"
    return (
        f"ReLibra's skewness across {what}",
        f"{name}.{table}",
        f"{lo:.2f}-{hi:.2f}",
        _span(means, ".3f"),
        _span(rows["skew_mean"], ".3f"),
        _range_verdict(means, lo, hi),
        "skewness is not a time: no breakdown term (relibra minimises T_MoE, not skewness)",
    )


def _overhead_rows(name: str, frame: pd.DataFrame) -> list[tuple[str, ...]]:
    rows = with_seed(frame[frame["planner"] == "relibra"])
    out: list[tuple[str, ...]] = []
    for model, (mib, _pct) in paper.REPLICA_BUFFER.items():
        buf = rows[rows["model"] == model]["replica_buffer_bytes"] / MIB
        if buf.empty:
            continue
        ours = float(buf.mean())
        out.append(
            (
                f"replica buffer, {model} (MiB)",
                f"{name}.overhead",
                f"{mib:.0f}",
                f"{ours:.1f}",
                _span(buf, ".1f"),
                _single_verdict(ours, mib),
                NO_TIME_TERM,
            )
        )
    share = 100.0 * rows["t_reorder_s"] / rows["step_time_s"]
    per_model = share.groupby(rows["model"]).mean()
    lo, hi = paper.REORDER_OVERHEAD_PCT
    verdict = _range_verdict(per_model, lo, hi)
    moved = rows["reorder_moved_experts"].mean() if "reorder_moved_experts" in rows else float("nan")
    cause = f"migration s {rows['t_reorder_s'].mean():.3f} per step; moved (layer, expert) pairs {moved:.0f}"
    out.append(
        (
            "reordering overhead (% of batch time)",
            f"{name}.overhead",
            f"{lo:.1f}-{hi:.1f}",
            _span(per_model),
            _span(share),
            verdict,
            "–" if verdict == "reproduced" else cause,
        )
    )
    plan = rows["plan_time_s"] / rows["num_batches"] if "num_batches" in rows else rows["plan_time_s"]
    critical = rows["t_critical_path_s"].mean() if "t_critical_path_s" in rows else float("nan")
    out.append(
        (
            "solving hidden behind post-rollout processing",
            f"{name}.overhead",
            "hidden",
            f"plan {plan.mean():.3f} s/batch",
            _span(plan, ".3f"),
            "not comparable",
            f"{NOT_MODELLED} {critical:.3f} s",
        )
    )
    return out


def paper_claims(by_experiment: Mapping[str, pd.DataFrame]) -> Table:
    """Every claim of the paper the present results can speak to, judged by :data:`RULE`."""
    rows: list[tuple[str, ...]] = []
    if (got := _pick(by_experiment, "overall")) is not None:
        rows += _overall_rows(*got)
    if (got := _pick(by_experiment, "ablation")) is not None:
        rows += _ablation_rows(*got)
    if (got := _pick(by_experiment, "ep_scaling")) is not None and "relibra" in set(got[1]["planner"]):
        rows.append(_skew_rows(*got, "EP", paper.SKEW_BY_EP["relibra"], "EP 8-64"))
    if (got := _pick(by_experiment, "datasets")) is not None and "relibra" in set(got[1]["planner"]):
        rows.append(_skew_rows(*got, "dataset", paper.SKEW_BY_DATASET["relibra"], "datasets"))
    if (got := _pick(by_experiment, "overhead")) is not None and "relibra" in set(got[1]["planner"]):
        rows += _overhead_rows(*got)
    if not rows:
        raise ValueError(
            "paper_claims needs finished cells of overall, ablation, ep_scaling, datasets or overhead"
        )
    return Table(
        "paper_claims",
        "The paper's claims: ours beside each, with a verdict and the measured cause of a difference",
        pd.DataFrame(rows, columns=COLUMNS),
        note=RULE,
    )
