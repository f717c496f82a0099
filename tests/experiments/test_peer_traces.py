"""The peer presets' trace files (experiments.grid.peer_traces) and their parallel dimensions' memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.config.build import build_cluster, build_cost, build_model, build_workload_for, load_counts
from experiments.config.parallel_check import memory_problems, workload_memory_problems
from experiments.config.presets import cells, compose_cells
from experiments.config.spec import build_spec
from experiments.grid.peer_traces import PEER_DIR, peer_args, prepare_peer_traces
from relibra.trace.format import load_trace
from relibra.trace.peer import routes_for_step

TINY = ["peer.steps=2", "peer.tokens=8", "model=qwen3-30b-a3b", "peer.ep=small", "peer.workload=W2_hot_rank"]
"""One trace of the peer preset: two steps of 8 tokens per rank."""


def test_each_trace_is_written_once_and_a_stale_one_again(tmp_path: Path) -> None:
    written: list[str] = []
    override = prepare_peer_traces("peer", tmp_path, TINY, log=written.append)
    folder = tmp_path.joinpath(*PEER_DIR)
    assert override == f"peer.dir={folder}" and len(written) == 1
    path = Path(written[0].split(": ", 1)[1])
    trace = load_trace(path)
    ids, _ = routes_for_step("W2_hot_rank", 128, 8, 8, 1, 0)
    assert (trace.num_batches, trace.num_samples) == (2, 16) and (trace.sample(8)[:, 0] == ids).all()
    prepare_peer_traces("peer", tmp_path, TINY, log=written.append)
    assert len(written) == 1  # kept: its meta names these arguments
    path.write_bytes(b"not a trace")
    prepare_peer_traces("peer", tmp_path, TINY, log=written.append)
    assert len(written) == 2 and load_trace(path).num_batches == 2


@pytest.mark.parametrize(
    ("model", "ep"), [(m, e) for m in ("qwen3-30b-a3b", "deepseek-v3") for e in ("small", "large")]
)
def test_every_peer_shape_fits_memory_with_its_tokens(model: str, ep: str, tmp_path: Path) -> None:
    """The preset's parallel dimensions (DeepSeek-V3: 8 stages, 2 replicas) at 1024 tokens per rank, one
    step."""
    shape = [f"model={model}", f"peer.ep={ep}", "peer.workload=W0_balanced", "peer.steps=1"]
    override = prepare_peer_traces("peer", tmp_path, shape, log=lambda _: None)
    cell = cells("peer", [*shape, override, "planner=megatron", "simulator.memory_check=error"])
    cfg = compose_cells("peer", cell)[0]
    assert peer_args(build_spec(cfg)).tokens == 1024
    cluster, spec = build_cluster(build_spec(cfg)), build_model(build_spec(cfg))
    cost = build_cost(build_spec(cfg), cluster, spec)
    assert memory_problems(build_spec(cfg), cost) == []
    _, work = build_workload_for(build_spec(cfg), load_counts(build_spec(cfg)), cluster.num_gpus)
    assert workload_memory_problems(build_spec(cfg), cost, work.tokens, work.mb_batch) == []


def test_cli_writes_the_traces_and_prints_the_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.grid.peer_traces import main

    assert main(["quick_peer", "--results", str(tmp_path), "peer.workload=W0_balanced", "peer.steps=1"]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith(f"peer.dir={tmp_path.joinpath(*PEER_DIR)}")
    assert len(list(tmp_path.joinpath(*PEER_DIR).glob("*.npz"))) == 1
    assert main(["overall", "--results", str(tmp_path)]) == 2
    assert "not a peer preset" in capsys.readouterr().err
