"""The one constant of the whole step fitted to published end-to-end runs: ``python -m experiments.validate
--end-to-end --fit``.

What is fitted, and to what, was decided before any fit (docs/validation.md, "Calibration"):

* the constant: ``training.host_overhead_s``, exposed host seconds per MoE layer, pass direction and
  micro-batch (:meth:`relibra.cost.step.WholeStepTerms.launch_time`), paid by runs whose expert path is
  launched from the host (``training.cuda_graph`` ``none`` or ``partial``);
* the rows: every ``calibration`` row of ``experiments/data/end_to_end.json`` (no ``check`` row is read:
  :func:`fit_host_overhead` takes the calibration rows only, and
  :func:`experiments.validation.end_to_end.check_roles` refuses a file whose fit names a check row);
* the objective: least squares of ``log(model / published)`` over those rows, the value bounded below by 0.

A row's simulated seconds per token are linear in the constant wherever the slowest pipeline stage stays
the same and each overlapped gradient collective stays exposed or hidden (the host time is a sum over
micro-batches and layers, apportioned to stages by their MoE layers; it also widens the windows the
collectives hide in, :func:`relibra.cost.passes._exposed_collectives`), so each row is simulated at 0 and
at :data:`PROBE_S`, the objective is minimised on that line, and every row is simulated again at the
fitted value: the fit's ratios are those of the real model, not of the line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.validation.end_to_end import simulate_row

__all__ = ["FITTED", "PROBE_S", "HostOverheadFit", "fit_host_overhead", "minimise_log_error"]

FITTED = "training.host_overhead_s"
"""The fitted constant's key."""
PROBE_S = 1e-3
"""The second point of each row's line (seconds per MoE layer, direction and micro-batch)."""
_GRID = 4001
"""Points of the first search over ``[0, upper]`` (then refined between the best point's neighbours)."""

Simulate = Callable[[dict[str, Any], Sequence[str]], dict[str, float]]


@dataclass(frozen=True)
class HostOverheadFit:
    """The fitted ``training.host_overhead_s`` and what it was fitted to. Tuples are per calibration row,
    in the data file's order."""

    value: float
    """Seconds per MoE layer, pass direction and micro-batch."""
    rows: tuple[str, ...]
    """The calibration rows' ids."""
    ratios_before: tuple[float, ...]
    """model / published of each row at 0 (the constant of ``experiments/conf``)."""
    ratios: tuple[float, ...]
    """model / published of each row simulated again at :attr:`value`."""
    leave_one_out: tuple[float, ...]
    """The value fitted without each row in turn (on the rows' lines; one row: the value itself): how far
    one row moves it."""

    @property
    def log_rms(self) -> float:
        """Root mean square of ``log(model / published)`` at the fitted value."""
        return float(np.sqrt(np.mean(np.log(np.asarray(self.ratios)) ** 2)))

    def entry(self) -> dict[str, Any]:
        """The data file's ``fitted_constants`` entry: value, rows, objective."""
        return {
            "value": self.value,
            "rows": list(self.rows),
            "objective": "least squares of log(model / published) over the calibration rows, value >= 0 "
            "(experiments/validation/end_to_end_fit.py)",
            "log_rms": round(self.log_rms, 6),
            "leave_one_out": [min(self.leave_one_out), max(self.leave_one_out)],
        }


def minimise_log_error(inv0: np.ndarray, slope: np.ndarray, target: np.ndarray, upper: float) -> float:
    """``h`` in ``[0, upper]`` minimising ``sum((log(inv0 + slope * h) - log(target)) ** 2)``: a grid of
    :data:`_GRID` points, then golden-section search between the best point's neighbours.

    ``inv0`` float64 [R]: each row's simulated seconds per token and GPU at ``h = 0``; ``slope`` [R]: their
    change per second of ``h``; ``target`` [R]: the published seconds per token and GPU (1 / value).
    """

    def objective(h: np.ndarray) -> np.ndarray:
        model = inv0[None, :] + slope[None, :] * h[:, None]
        return np.sum((np.log(model) - np.log(target)[None, :]) ** 2, axis=1)

    grid = np.linspace(0.0, upper, _GRID)
    k = int(np.argmin(objective(grid)))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, _GRID - 1)]
    ratio = (math.sqrt(5.0) - 1.0) / 2.0
    for _ in range(80):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        fa, fb = objective(np.array([a, b]))
        if fa <= fb:
            hi = b
        else:
            lo = a
    best = 0.5 * (lo + hi)
    # NOTE: a tie keeps the grid point (the bound 0 itself when the error only grows from there).
    return float(best if objective(np.array([best]))[0] < objective(np.array([grid[k]]))[0] else grid[k])


def fit_host_overhead(
    doc: dict[str, Any], simulate: Simulate = simulate_row, probe: float = PROBE_S
) -> HostOverheadFit:
    """Fit :data:`FITTED` to the ``calibration`` rows of ``doc`` (module doc). ``simulate(row, constants)``
    returns the row's ``model`` tokens/s/GPU (:func:`experiments.validation.end_to_end.simulate_row`); check
    rows are never passed to it. Refuses a file without simulated calibration rows, or whose rows do not
    depend on the constant (every one under a full-iteration CUDA graph)."""
    rows = [r for r in doc["rows"] if r.get("role") == "calibration" and not r.get("needs")]
    if not rows:
        raise ValueError(f"fit {FITTED}: the data has no simulated calibration rows")
    zero = np.array([simulate(r, (f"{FITTED}=0.0",))["model"] for r in rows])
    probed = np.array([simulate(r, (f"{FITTED}={probe!r}",))["model"] for r in rows])
    target = np.array([1.0 / float(r["value"]) for r in rows])
    inv0, slope = 1.0 / zero, (1.0 / probed - 1.0 / zero) / probe
    if not (slope > 0).any():
        raise ValueError(
            f"fit {FITTED}: no calibration row depends on it (all under training.cuda_graph=full_iteration?)"
        )
    # NOTE: past the point where every row with a slope is as slow as published, the error only grows.
    dependent = slope > 0
    upper = 2.0 * max(float(np.max((target[dependent] - inv0[dependent]) / slope[dependent])), probe)
    value = float(minimise_log_error(inv0, slope, target, upper))
    keep = ~np.eye(len(rows), dtype=bool)
    loo = (
        [float(minimise_log_error(inv0[k], slope[k], target[k], upper)) for k in keep]
        if len(rows) > 1
        else []
    )
    ratios = [simulate(r, (f"{FITTED}={value!r}",))["model"] / float(r["value"]) for r in rows]
    return HostOverheadFit(
        value=value,
        rows=tuple(str(r["id"]) for r in rows),
        ratios_before=tuple(float(z * t) for z, t in zip(zero, target, strict=True)),
        ratios=tuple(float(x) for x in ratios),
        leave_one_out=tuple(loo) or (float(value),),
    )
