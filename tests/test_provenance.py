"""``code_version`` where git cannot say: what is known is recorded, and the run says the rest is unknown."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from relibra import __version__, provenance


def _repo(root: Path) -> str:
    """A one-commit checkout with a package file; returns its commit (12 hex digits)."""
    git = ["git", "-C", str(root), "-c", "user.email=t@t", "-c", "user.name=t"]
    (root / "relibra").mkdir(parents=True)
    (root / "relibra" / "code.py").write_text("x = 1\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "relibra/code.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    out = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    def version(root: Path) -> tuple[str, str | None]:
        monkeypatch.setattr(provenance, "_ROOT", root)
        provenance.code_version.cache_clear()
        provenance.code_version_note.cache_clear()
        return provenance.code_version(), provenance.code_version_note()

    yield version
    provenance.code_version.cache_clear()
    provenance.code_version_note.cache_clear()


def _refuse_git(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    """git as in a checkout owned by another user (its message, as git 2.35.2 and later print it)."""
    said = f"fatal: detected dubious ownership in repository at '{root}'"
    monkeypatch.setattr(provenance, "_run_git", lambda *args: (None, said))


def test_a_refused_checkout_records_its_commit_and_a_hash_of_its_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh, caplog: pytest.LogCaptureFixture
) -> None:
    commit = _repo(tmp_path)
    clean, note = fresh(tmp_path)
    assert clean == f"{__version__}+g{commit}" and note is None
    _refuse_git(monkeypatch, tmp_path)
    refused, note = fresh(tmp_path)
    assert refused.startswith(f"{__version__}+g{commit}.src.") and refused != clean
    assert note is not None and "dubious ownership" in note and "unknown" in note and refused in note
    assert any("dubious ownership" in r.getMessage() for r in caplog.records)  # in the run's output
    (tmp_path / "relibra" / "code.py").write_text("x = 2\n")  # a tracked file edited
    edit_a, _ = fresh(tmp_path)
    (tmp_path / "relibra" / "code.py").write_text("x = 3\n")
    edit_b, _ = fresh(tmp_path)
    assert len({refused, edit_a, edit_b}) == 3
    assert all(provenance.identifies_code(v) for v in (clean, refused, edit_a, edit_b))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("git") is None, reason="needs root to chown")
def test_a_checkout_owned_by_another_user_is_not_recorded_as_the_bare_version(tmp_path: Path, fresh) -> None:
    """The issue's probe, with git's real refusal: the checkout belongs to another user."""
    commit = _repo(tmp_path)
    (tmp_path / "relibra" / "code.py").write_text("x = 2\n")
    subprocess.run(["chown", "-R", "nobody", str(tmp_path)], check=True)
    version, note = fresh(tmp_path)
    assert version != __version__ and version.startswith(f"{__version__}+g{commit}.src.")
    assert note is not None and "dubious ownership" in note


def test_no_checkout_is_recorded_by_its_sources(tmp_path: Path, fresh) -> None:
    (tmp_path / "relibra").mkdir()
    (tmp_path / "relibra" / "code.py").write_text("x = 1\n")
    version, note = fresh(tmp_path)
    assert version.startswith(f"{__version__}+src.") and note is not None and "no git checkout" in note


def test_only_a_version_with_a_commit_or_a_source_hash_names_code() -> None:
    assert provenance.identifies_code("0.1.0+g1a2b3c4d5e6f")
    assert provenance.identifies_code("0.1.0+g1a2b3c4d5e6f.dirty.9f86d081884c")
    assert provenance.identifies_code("0.1.0+src.0c1d2e3f4a5b")
    assert not provenance.identifies_code("0.1.0")
    assert not provenance.identifies_code("unknown")


def test_reproduce_counts_a_cell_of_a_version_that_names_no_code_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored ``0.1.0`` cell is stale even when the current code also reads ``0.1.0``: unknown is not
    equal; ``--recompute-stale`` recomputes it."""
    import pandas as pd

    from experiments.grid import runner
    from experiments.store.results_store import ResultsStore

    overrides = ["model=qwen3-30b-a3b", "planner=relibra"]
    report, jobs = runner.plan_grid("quick_overhead", tmp_path, overrides)
    assert len(jobs) == 1
    rows = pd.DataFrame({"planner": ["relibra"], "step_time_s": [1.0], "code_version": ["0.1.0"]})
    ResultsStore(tmp_path / "quick_overhead").write(jobs[0].key, rows, jobs[0].spec.composed)
    monkeypatch.setattr(runner, "code_version", lambda: "0.1.0")
    report, jobs = runner.plan_grid("quick_overhead", tmp_path, overrides)
    assert report.stale == {"0.1.0": 1} and report.reused == 1 and not jobs
    report, jobs = runner.plan_grid("quick_overhead", tmp_path, overrides, recompute_stale=True)
    assert report.stale == {"0.1.0": 1} and len(jobs) == 1 and jobs[0].recompute


def test_reproduce_says_the_code_version_is_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.grid import cli

    note = "git cannot read the checkout /x (fatal: detected dubious ownership): the code version is unknown"
    monkeypatch.setattr(cli, "code_version_note", lambda: note)
    args = ["--results", str(tmp_path), "--presets", "quick_overhead", "--no-analysis", "--workers", "1"]
    tiny = ["trace.num_batches=1", "trace.samples_per_batch=16", "trace.max_tokens=64", "cluster.nodes=1"]
    assert cli.main([*args, "model=qwen3-30b-a3b", "planner=megatron", *tiny]) == 0
    assert f"code version: {note}" in capsys.readouterr().out
