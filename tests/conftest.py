"""Shared fixtures. Tests that read ../shared/traces skip cleanly where that folder is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
    import experiments.wandb_logger as wandb_logger

    monkeypatch.setattr(wandb_logger, "_FAILED", [])
