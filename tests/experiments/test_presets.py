"""Experiment presets: every cell of every preset composes and validates; each runs in a tiny mode."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import experiments.run as run_module
from experiments.config.build import build_cluster
from experiments.config.checks import check_config
from experiments.config.presets import cells, compose_cell, compose_cells, presets
from experiments.config.spec import build_spec
from experiments.grid.jobs import GridReport
from experiments.grid.peer_traces import PEER_DIR, is_peer_preset, prepare_peer_traces
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore

FULL = ["overall", "overall_deepep", "ablation", "ep_scaling", "nvl72", "datasets", "overhead", "real_trace"]
ALL = FULL + [f"quick_{p}" for p in FULL] + ["peer", "quick_peer"]
PLANNERS = {
    "megatron",
    "popfetcher",
    "eplb",
    "lplb",
    "ultraep",
    "llep",
    "moonep",
    "echo",
    "relibra_replicate_only",
    "relibra",
    "relibra_portfolio",
    "foremoe",
    "balanced",
    "force_balanced",
}


MEMORY = "simulator.memory_check=warn"
"""The presets' cells are composed and run here for everything but their memory, which
tests/experiments/test_parallel_check.py checks (some of the paper's shapes do not fit, NOT_FITTING there)."""


def tiny(cfg_nodes: int) -> list[str]:
    """Tiny mode: one step of two rollouts per GPU of at most 64 tokens (model and EP size kept)."""
    return [
        "trace.num_batches=1",
        f"trace.samples_per_batch={2 * 8 * cfg_nodes}",
        "trace.max_tokens=64",
        MEMORY,
    ]


@pytest.fixture(scope="module")
def olmoe_like_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic trace with the OLMoE shape, standing in for the real one (which CI may lack)."""
    from relibra.trace.format import save_trace
    from relibra.trace.synthetic import generate_trace

    trace = generate_trace(
        "mixed",
        num_experts=64,
        num_layers=16,
        top_k=8,
        num_batches=1,
        samples_per_batch=32,
        seed=0,
        max_tokens=32,
    )
    return save_trace(trace, tmp_path_factory.mktemp("trace") / "olmoe-like.npz")


PEER_TINY = ["peer.steps=1", "peer.tokens=8"]
"""The peer presets' cells on traces of one step of 8 tokens per rank (model and EP size kept)."""


@pytest.fixture(scope="module")
def peer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny trace files of every cell of the peer presets (experiments.grid.peer_traces)."""
    root = tmp_path_factory.mktemp("peer")
    for preset in ("peer", "quick_peer"):
        prepare_peer_traces(preset, root, PEER_TINY, log=lambda _: None)
    return root.joinpath(*PEER_DIR)


def _extra(preset: str, trace: Path, peer: Path | None = None) -> list[str]:
    if is_peer_preset(preset):
        return [f"peer.dir={peer}", *PEER_TINY, MEMORY]
    return [f"trace.path={trace}", MEMORY] if preset.removeprefix("quick_") == "real_trace" else [MEMORY]


def test_every_paper_preset_and_its_quick_variant_exist() -> None:
    assert set(ALL) <= set(presets())


def covering(grid: list[list[str]]) -> list[list[str]]:
    """Cells in which every swept value (every model, dataset, planner, EP size) appears at least once."""
    axes = [sorted({cell[i] for cell in grid}) for i in range(len(grid[0]))]
    width = max(len(values) for values in axes)
    picked = {tuple(values[j % len(values)] for values in axes) for j in range(width)}
    return [list(cell) for cell in grid if tuple(cell) in picked]


def _check_cells(
    preset: str, grid: list[list[str]], trace: Path, request: pytest.FixtureRequest | None = None
) -> None:
    keys = set()
    peer = request.getfixturevalue("peer_dir") if request and is_peer_preset(preset) else None
    for cfg in compose_cells(preset, [[*cell, *_extra(preset, trace, peer)] for cell in grid]):
        check_config(cfg)
        assert cfg.experiment_name == preset
        assert Path(cfg.results_dir).name == preset
        keys.add(cell_key(cfg))
    assert len(keys) == len(grid), f"{preset}: two cells share a config"


@pytest.mark.parametrize("preset", ALL)
def test_every_swept_value_composes_and_validates(
    preset: str, olmoe_like_trace: Path, request: pytest.FixtureRequest
) -> None:
    grid = cells(preset)
    assert grid, f"{preset} has no cells"
    subset = covering(grid)
    for i in range(len(grid[0])):
        assert {c[i] for c in subset} == {c[i] for c in grid}
    _check_cells(preset, subset, olmoe_like_trace, request)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ALL)
def test_every_cell_composes_and_validates(
    preset: str, olmoe_like_trace: Path, request: pytest.FixtureRequest
) -> None:
    _check_cells(preset, cells(preset), olmoe_like_trace, request)


@pytest.mark.parametrize("preset", FULL)
def test_quick_variant_keeps_the_grid_and_the_step_and_runs_fewer_steps(preset: str) -> None:
    full, quick = cells(preset), cells(f"quick_{preset}")
    if preset != "real_trace":  # NOTE: the quick grid is the full one at its first trace seed
        assert quick == [cell for cell in full if "seed=0" in cell]
    else:
        assert set(map(tuple, quick)) <= set(map(tuple, full))
    f, q = compose_cell(preset, full[0]), compose_cell(f"quick_{preset}", quick[0])
    assert (f.model.name, f.cluster.nodes) == (q.model.name, q.cluster.nodes)
    if preset != "real_trace":  # NOTE: the tokens of one RL step are the paper's; only steps are fewer
        step = [(c.trace.samples_per_batch, c.trace.max_tokens) for c in (q, f)]
        assert step[0] == step[1]
        assert (q.trace.preset, q.workload) == (f.trace.preset, f.workload)
        assert q.trace.num_batches < f.trace.num_batches


@pytest.mark.parametrize("preset", FULL)
def test_paper_scale_grids_run_three_trace_seeds_and_quick_ones_one(preset: str) -> None:
    def seeds(name: str) -> set[str]:
        return {dict(o.split("=", 1) for o in cell).get("seed", "0") for cell in cells(name)}

    # NOTE: real_trace replays one recorded trace: a trace seed would draw nothing new
    assert seeds(preset) == ({"0"} if preset == "real_trace" else {"0", "1", "2"})
    assert seeds(f"quick_{preset}") == {"0"}


def test_overall_covers_models_datasets_planners_at_paper_ep_sizes() -> None:
    grid = [dict(o.split("=", 1) for o in cell) for cell in cells("overall")]
    assert {c["model"] for c in grid} == {"qwen3-30b-a3b", "glm4.5-106b-a12b", "qwen3-235b-a22b"}
    assert {c["trace.preset"] for c in grid} == {"reasoning", "instruction_following", "coding", "mixed"}
    assert {c["planner"] for c in grid} == PLANNERS
    for model in ("qwen3-30b-a3b", "glm4.5-106b-a12b", "qwen3-235b-a22b"):
        cfg = compose_cell("overall", [f"model={model}"])
        g = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        assert 32 <= g <= 160 and cfg.model.num_experts % g == 0


def test_overall_deepep_is_overall_under_the_deepep_dispatcher() -> None:
    """The headline's DeepEP row: overall's cells, one for one, with only the dispatcher changed."""
    for preset in ("overall_deepep", "quick_overall_deepep"):
        base = preset.replace("_deepep", "")
        grid = cells(preset)
        assert sorted(map(sorted, grid)) == sorted(map(sorted, cells(base)))
        for cfg_a, cfg_b in zip(compose_cells(preset, grid[:3]), compose_cells(base, grid[:3])):
            assert (cfg_a.cluster.dispatcher, cfg_b.cluster.dispatcher) == ("deepep", "alltoall")
            assert cfg_a.cluster.ep_overlap is False
            assert cfg_a.planner == cfg_b.planner and cfg_a.model == cfg_b.model


def test_nvl72_holds_every_ep_group_in_one_nvlink_domain() -> None:
    """EP 8-64 on GB200 NVL72 trays of 4: every cell's group lies in one 72-GPU domain."""
    grid = [dict(o.split("=", 1) for o in cell) for cell in cells("nvl72")]
    assert {c["cluster.nodes"] for c in grid} == {"2", "4", "8", "16"}
    assert {"moonep", "ultraep", "llep", "relibra", "foremoe", "force_balanced"} <= {
        c["planner"] for c in grid
    }
    for nodes in (2, 16):
        cluster = build_cluster(build_spec(compose_cell("nvl72", [f"cluster.nodes={nodes}"])))
        assert (cluster.gpus_per_node, cluster.nvl_domain) == (4, 72)
        assert cluster.num_domains == 1 and cluster.domain_gpus == 4 * nodes


def _first_cell_per_planner(preset: str) -> list[list[str]]:
    seen: dict[str, list[str]] = {}
    for cell in cells(preset):
        planner = dict(o.split("=", 1) for o in cell).get("planner", "relibra")
        seen.setdefault(planner, cell)
    return list(seen.values())


# NOTE: `overall` (about 24 s) runs in `make test-slow`; `overall_deepep` extends it and stays in the
# default run.
@pytest.mark.parametrize(
    "preset", [pytest.param(p, marks=pytest.mark.slow) if p == "overall" else p for p in FULL]
)
def test_preset_runs_in_tiny_mode_and_reruns_from_the_store(
    preset: str, tmp_path: Path, olmoe_like_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first cell of each planner runs tiny; a rerun reuses every finished cell and computes nothing."""
    chosen = _first_cell_per_planner(preset) if preset in ("overall", "real_trace") else cells(preset)[:1]
    configs = []
    for cell in chosen:
        probe = compose_cell(preset, [*cell, *_extra(preset, olmoe_like_trace)])
        cfg = compose_cell(
            preset,
            [
                *cell,
                *tiny(int(probe.cluster.nodes)),
                *_extra(preset, olmoe_like_trace),
                f"results_dir={tmp_path}",
            ],
        )
        out = run_module.run(cfg, run_dir=tmp_path / "runs" / cell_key(cfg))
        assert len(out) == 1 and out["step_time_s"].iloc[0] > 0
        configs.append((cfg, out))
    store = ResultsStore(tmp_path)
    assert len(store.keys()) == len(chosen)

    def must_not_run(cfg):  # type: ignore[no-untyped-def]
        raise AssertionError("a finished cell was computed again")

    monkeypatch.setattr(run_module, "compute", must_not_run)
    for cfg, out in configs:
        pd.testing.assert_frame_equal(
            run_module.run(cfg, run_dir=tmp_path / "again").reset_index(drop=True), out.reset_index(drop=True)
        )


@pytest.mark.slow
@pytest.mark.parametrize("preset", [f"quick_{p}" for p in FULL])
def test_every_quick_cell_runs_in_tiny_mode(preset: str, tmp_path: Path, olmoe_like_trace: Path) -> None:
    for cell in cells(preset):
        probe = compose_cell(preset, [*cell, *_extra(preset, olmoe_like_trace)])
        cfg = compose_cell(
            preset,
            [
                *cell,
                *tiny(int(probe.cluster.nodes)),
                *_extra(preset, olmoe_like_trace),
                f"results_dir={tmp_path}",
            ],
        )
        run_module.run(cfg, run_dir=tmp_path / "runs" / cell_key(cfg))
    assert len(ResultsStore(tmp_path).keys()) == len(cells(preset))


def test_reproduce_runs_a_preset_then_reuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make reproduce` on one preset in tiny mode: cells, tables, figures; a rerun computes nothing."""
    from experiments.grid import cli

    args = [
        "--results",
        str(tmp_path),
        "--presets",
        "quick_ep_scaling",
        "--workers",
        "1",  # NOTE: in this process, so that the monkeypatch below reaches the cells
        "cluster.nodes=1,2",
        "planner=megatron,relibra,relibra_portfolio",  # NOTE: its other planners would add time only
        *tiny(2),
    ]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "6 cells run, 0 reused, 0 failed" in printed and "Skewness" in printed and "paper" in printed
    assert (tmp_path / "analysis" / "quick_ep_scaling.skew_by_ep.md").is_file()
    assert (tmp_path / "analysis" / "figures" / "quick_ep_scaling.skew_by_ep.png").is_file()

    def must_not_run(cfg):  # type: ignore[no-untyped-def]
        raise AssertionError("a finished cell was computed again")

    monkeypatch.setattr(run_module, "compute", must_not_run)
    assert cli.main([*args, "--no-analysis"]) == 0
    assert "0 cells run, 6 reused, 0 failed" in capsys.readouterr().out


def test_real_trace_preset_reads_the_shared_olmoe_trace(shared_traces: Path, tmp_path: Path) -> None:
    from experiments.grid.runner import prepare_olmoe_trace
    from relibra.trace.format import load_trace

    path = prepare_olmoe_trace(shared_traces, tmp_path / "olmoe-decode.npz")
    assert path is not None
    trace = load_trace(path)
    assert (trace.num_samples, trace.num_batches, trace.num_layers, trace.num_experts) == (200, 2, 16, 64)
    for cfg in compose_cells(
        "quick_real_trace", [[*c, f"trace.path={path}"] for c in cells("quick_real_trace")]
    ):
        check_config(cfg)
    assert prepare_olmoe_trace(tmp_path / "absent", tmp_path / "other.npz") is None


@pytest.mark.slow
def test_reproduce_reports_and_recomputes_cells_of_other_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cells stored by other code are reused with a warning, or recomputed with --recompute-stale."""
    from experiments.grid import cli, runner
    from experiments.store.access import stored_code_version
    from experiments.store.results_store import ResultsStore
    from relibra.provenance import code_version

    args = ["--results", str(tmp_path), "--presets", "quick_ep_scaling", "--workers", "1"]
    args += ["cluster.nodes=1", *tiny(1)]
    assert cli.main([*args, "--no-analysis"]) == 0
    store = ResultsStore(tmp_path / "quick_ep_scaling")
    assert {stored_code_version(store.read(k)) for k in store.keys()} == {code_version()}
    capsys.readouterr()

    for module in (runner, cli):  # the code has moved on
        monkeypatch.setattr(module, "code_version", lambda: "9.9.9+gnewer")
    assert cli.main([*args, "--no-analysis"]) == 0
    out = capsys.readouterr().out
    assert "0 cells run, 9 reused, 0 failed" in out
    assert f"9 finished cells came from other code than 9.9.9+gnewer (9 by {code_version()})" in out

    before = {k: store.cell_path(k).stat().st_mtime_ns for k in store.keys()}
    assert cli.main([*args, "--no-analysis", "--recompute-stale"]) == 0
    out = capsys.readouterr().out
    assert "9 cells run, 0 reused, 0 failed" in out and "recomputed" in out
    assert all(store.cell_path(k).stat().st_mtime_ns != t for k, t in before.items())


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            [],
            [
                "quick_overall",
                "quick_ablation",
                "quick_ep_scaling",
                "quick_datasets",
                "quick_overhead",
            ],
        ),
        (
            ["--scale", "quick-field"],
            [
                "quick_overall_deepep",
                "quick_nvl72",
                "quick_whole_step_shift",
                "quick_comm_sensitivity",
                "quick_peer",
            ],
        ),
        (["--scale", "paper"], ["overall", "ablation", "ep_scaling", "datasets", "overhead"]),
        (
            ["--scale", "field"],
            ["overall_deepep", "nvl72", "comm_sensitivity", "comm_sensitivity_overall", "peer"],
        ),
        (["--scale", "paper", "--presets", "datasets"], ["datasets"]),
    ],
)
def test_reproduce_scale_selects_the_presets(
    argv: list[str], expected: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --scale (make reproduce) runs the paper's six grids at the quick scale, `--scale quick-field`
    (make reproduce-quick-field) the grids beyond the paper at it, `--scale paper` (make reproduce-paper) the
    paper's six at its scale, `--scale field` (make reproduce-field) the grids beyond the paper; --presets
    wins."""
    from experiments.grid import cli, runner

    ran: list[str] = []

    def record(preset, root, overrides, recompute_stale=False, extend_grid=False):  # type: ignore[no-untyped-def]
        ran.append(preset)
        return GridReport(preset), []

    monkeypatch.setattr(runner, "plan_grid", record)
    monkeypatch.setattr(cli, "prepare_olmoe_trace", lambda shared, out: None)  # real_trace: skipped
    monkeypatch.setattr(cli, "prepare_peer_traces", lambda *args: "peer.dir=unused")
    # NOTE: one worker, so that the grids are planned in this process, where plan_grid is replaced
    assert cli.main(["--results", str(tmp_path), "--no-analysis", "--workers", "1", *argv]) == 0
    assert ran == expected


COMM = ["comm_sensitivity", "comm_sensitivity_overall", "quick_comm_sensitivity"]


@pytest.mark.parametrize("preset", COMM)
def test_communication_sensitivity_presets_compose_and_validate(preset: str, olmoe_like_trace: Path) -> None:
    grid = cells(preset)
    assert {c for cell in grid for c in cell if c.startswith("cluster.dispatcher=")} == {
        "cluster.dispatcher=alltoall",
        "cluster.dispatcher=deepep",
    }
    assert {c for cell in grid for c in cell if c.startswith("cluster.ep_overlap=")} == {
        "cluster.ep_overlap=False",
        "cluster.ep_overlap=True",
    }
    _check_cells(preset, covering(grid), olmoe_like_trace)


def test_quick_communication_sensitivity_keeps_two_microbatches_at_ep64() -> None:
    cfg = compose_cell("quick_comm_sensitivity", ["cluster.nodes=8", "cluster.ep_overlap=true"])
    per_gpu = cfg.trace.samples_per_batch // (cfg.cluster.nodes * cfg.cluster.gpus_per_node)
    assert per_gpu // cfg.workload.samples_per_microbatch >= 2
