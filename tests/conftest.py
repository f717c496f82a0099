"""Shared fixtures. Tests that read ../shared/traces skip cleanly where that folder is absent."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from relibra.trace.format import RoutingTrace, save_trace

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACES = Path(os.environ.get("RELIBRA_SHARED_TRACES", REPO.parent / "shared" / "traces"))


@pytest.fixture
def shared_traces() -> Path:
    """Path of the real routing traces (../shared/traces); skips the test where it is absent."""
    if not SHARED_TRACES.is_dir():
        pytest.skip(f"real traces not found at {SHARED_TRACES} (set RELIBRA_SHARED_TRACES to point at them)")
    return SHARED_TRACES


@pytest.fixture(autouse=True)
def _fresh_wandb_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process would: no W&B failure remembered from an earlier test."""
    import experiments.tracking.wandb_logger as wandb_logger

    monkeypatch.setattr(wandb_logger, "_FAILED", [])


@pytest.fixture(scope="session")
def trace_file(tmp_path_factory) -> Path:
    """A small OLMoE-shaped trace (16 layers, 64 experts, top-8) written by the trace module."""
    rng = np.random.default_rng(1)
    lens = rng.integers(4, 20, size=16)
    num_layers, num_experts, k = 16, 64, 8
    scores = rng.gumbel(size=(int(lens.sum()), num_layers, num_experts)) + np.log(
        1.0 / np.arange(1, num_experts + 1)
    )
    experts = np.argsort(-scores, axis=-1)[..., :k].astype(np.int16)
    trace = RoutingTrace(
        experts=experts,
        sample_offsets=np.r_[0, np.cumsum(lens)].astype(np.int64),
        batch_offsets=np.array([0, 8, 16], dtype=np.int64),
        meta={
            "num_experts": num_experts,
            "top_k": k,
            "num_layers": num_layers,
            "model": "olmoe",
            "source": "test",
        },
    )
    return save_trace(trace, tmp_path_factory.mktemp("trace") / "olmoe_test.npz")
