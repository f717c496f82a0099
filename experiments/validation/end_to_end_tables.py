"""The end-to-end validation as generated tables (``python -m experiments.validate --end-to-end
--write-tables docs/results``): ``end_to_end`` (one row per published measurement) and ``end_to_end_errors``
(the check rows' median and worst error) and ``end_to_end_fit`` (the fitted constants), which
docs/records/validation.md embeds as generated blocks
(:mod:`analysis.docs_blocks`), so its numbers are never copied by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from analysis.render import write_table
from analysis.tables import Table
from experiments.validation.end_to_end import errors
from relibra.provenance import code_version

__all__ = ["end_to_end_tables", "write_end_to_end_tables"]

_COLUMNS = {
    "id": "row",
    "role": "role",
    "published": "published tokens/s/GPU",
    "model": "model tokens/s/GPU",
    "ratio": "model / published",
    "model_unfitted": "before the fit tokens/s/GPU",
    "ratio_unfitted": "before the fit / published",
    "t_launch_s": "host s",
    "step_time_s": "step s",
    "t_compute_s": "expert GEMMs s",
    "t_comm_s": "all-to-all s",
    "t_attention_s": "attention s",
    "t_permute_s": "permutation s",
    "t_fp8_cast_s": "FP8 casts s",
    "t_other_s": "other s",
    "t_bubble_s": "bubble s",
    "t_p2p_s": "pipeline sends s",
    "t_tp_comm_s": "TP collectives s",
    "needs": "waits for",
}
_SETS = (("all", None), ("EP only", "ep"), ("PP/TP", "pp/tp"))


def end_to_end_tables(e2e: pd.DataFrame, command: str, fitted: dict[str, Any] | None = None) -> list[Table]:
    """The tables of :func:`experiments.validation.end_to_end.end_to_end_table`'s frame ``e2e``, and with
    ``fitted`` (the data file's ``fitted_constants``, non-empty) a third, ``end_to_end_fit``: each fitted
    constant's value, rows, log RMS error and leave-one-out range."""
    provenance = f"Provenance: simulated and written by `{command}` at `{code_version()}`."
    rows = e2e.reindex(columns=list(_COLUMNS)).rename(columns=_COLUMNS)
    formats = {c: ".2f" for c in rows.columns if c.endswith(" s")}
    formats.update(
        {"published tokens/s/GPU": ".0f", "model tokens/s/GPU": ".0f", "before the fit tokens/s/GPU": ".0f"}
    )
    table = Table(
        name="end_to_end",
        title="The whole step against published end-to-end training throughput (force-balanced, dropless)",
        frame=rows,
        formats=formats,
        note="Seconds are per step, summed over every stage's layers (the bubble and the sends: the slowest "
        "stage's); the model, step s and its terms are the simulated step with the constants of "
        "experiments/conf, which include those fitted to the calibration rows (fitted_constants of "
        "experiments/data/end_to_end.json; host s: the fitted host overhead per step). 'before the fit': "
        "the same row with every fitted constant at 0. Rows, sources and configurations: "
        "experiments/data/end_to_end.json.",
        provenance=provenance,
    )
    errs = []
    columns = [("experiments/conf", "ratio")]
    if "ratio_unfitted" in e2e:
        columns.append(("before the fit", "ratio_unfitted"))
    for constants, column in columns:
        for name, parallelism in _SETS:
            err = errors(e2e, parallelism, column)
            errs.append(
                {
                    "constants": constants,
                    "set": name,
                    "check rows": err["rows"],
                    "median %": 100 * err["median"],
                    "worst %": 100 * err["worst"],
                }
            )
    summary = Table(
        name="end_to_end_errors",
        title="Check rows: |model / published - 1| (target: median <= 15 %, none beyond 30 %), with the "
        "constants of experiments/conf (the fitted ones among them) and with the fitted ones at 0",
        frame=pd.DataFrame(errs),
        formats={"median %": ".0f", "worst %": ".0f"},
        provenance=provenance,
    )
    if not fitted:
        return [table, summary]
    fits = pd.DataFrame(
        [
            {
                "constant": key,
                "value": fit["value"],
                "calibration rows": len(fit["rows"]),
                "log RMS": fit.get("log_rms", float("nan")),
                "leave-one-out lo": min(fit.get("leave_one_out") or [float("nan")]),
                "leave-one-out hi": max(fit.get("leave_one_out") or [float("nan")]),
            }
            for key, fit in fitted.items()
        ]
    )
    fit_table = Table(
        name="end_to_end_fit",
        title="Constants fitted to the calibration rows (least squares of log(model / published))",
        frame=fits,
        formats={"value": ".4g", "log RMS": ".2f", "leave-one-out lo": ".4g", "leave-one-out hi": ".4g"},
        note="The rows and the objective: fitted_constants of experiments/data/end_to_end.json "
        "(python -m experiments.validate --end-to-end --fit); leave-one-out: the value fitted without each "
        "calibration row in turn.",
        provenance=provenance,
    )
    return [table, summary, fit_table]


def write_end_to_end_tables(
    e2e: pd.DataFrame, out_dir: Path, command: str, fitted: dict[str, Any] | None = None
) -> list[Path]:
    """Write the tables (Markdown and LaTeX) into ``out_dir``; returns the paths."""
    tables = end_to_end_tables(e2e, command, fitted)
    return [path for table in tables for path in write_table(table, out_dir)]
