"""The measured expert-GEMM curve that may replace the cost model's roofline curve
(:meth:`relibra.cost.model.CostModel.expert_time`; ``cluster.calibration``).

Calibration file (JSON): measured fwd+bwd seconds of one expert's grouped GEMM per token count, per model, as
``scripts/calibrate_gpu.py`` writes it::

    {"hardware": "H100-SXM", "models": {"qwen3-30b-a3b": {"tokens": [1, 64, 512, 4096],
                                                           "seconds": [2.1e-5, 2.4e-5, 9.0e-5, 6.1e-4]}}}

``tokens`` strictly increasing (at least 2 points), ``seconds`` non-negative, same length; a file written by
a ``--dry-run`` (``provenance.dry_run``) is refused. Read it with :func:`load_calibration`.
"""

from __future__ import annotations

import json
from os import PathLike

import numpy as np

__all__ = ["check_calibration", "load_calibration"]


def check_calibration(
    calibration: tuple[np.ndarray, np.ndarray], model: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [P], seconds [P])`` of ``model`` as float64 arrays; :class:`ValueError` naming the model
    when they do not make a curve (module doc)."""
    xs = np.asarray(calibration[0], dtype=np.float64)
    ys = np.asarray(calibration[1], dtype=np.float64)
    if xs.ndim != 1 or xs.shape != ys.shape or xs.shape[0] < 2:
        raise ValueError(
            f"calibration for model {model!r}: tokens {xs.shape} and seconds {ys.shape} must be 1-D of the "
            "same length with at least 2 points"
        )
    if np.any(np.diff(xs) <= 0) or xs[0] < 0:
        raise ValueError(f"calibration for model {model!r}: tokens must be >= 0 and strictly increasing")
    if np.any(ys < 0) or not np.all(np.isfinite(ys)):
        raise ValueError(f"calibration for model {model!r}: seconds must be finite and >= 0")
    return xs, ys


def load_calibration(path: str | PathLike[str], model: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Read the measured expert-GEMM curve of ``model`` from a calibration JSON (format: module doc).

    Returns (tokens [P], seconds [P]) or None when the file has no entry for ``model``.
    """
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration file {path}: not valid JSON ({exc})") from exc
    if isinstance(doc, dict) and isinstance(doc.get("provenance"), dict) and doc["provenance"].get("dry_run"):
        raise ValueError(f"calibration file {path}: written by a --dry-run (not a measurement); refusing it")
    models = doc.get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict):
        raise ValueError(f'calibration file {path}: expected an object with a "models" mapping')
    entry = models.get(model)
    if entry is None:
        return None
    if not isinstance(entry, dict) or "tokens" not in entry or "seconds" not in entry:
        raise ValueError(f'calibration file {path}: models.{model} needs "tokens" and "seconds" lists')
    return check_calibration((np.asarray(entry["tokens"]), np.asarray(entry["seconds"])), model)
