"""Analysis on a small synthetic results store: tables match the inputs, files and figures are written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from analysis import paper
from analysis.__main__ import analyse, main
from analysis.render import to_latex, to_markdown
from analysis.tables import (
    ablation,
    overall_cells,
    overall_summary,
    overhead,
    range_ratio,
    skew_by_ep,
    step_by_ep,
)
from experiments.store.keys import cell_key
from experiments.store.results_store import ResultsStore

# throughput factor of each planner over Megatron-LM, and its mean skewness, in the synthetic results
FACTOR = {
    "megatron": 1.0,
    "popfetcher": 1.2,
    "eplb": 1.3,
    "lplb": 1.25,
    "relibra": 1.5,
    "balanced": 1.6,
    "force_balanced": 1.4,
    "relibra_reorder_no_locality": 1.05,
    "relibra_reorder_only": 1.1,
}
SKEW = {
    "megatron": 1.6,
    "popfetcher": 1.4,
    "eplb": 1.3,
    "lplb": 1.3,
    "relibra": 1.05,
    "balanced": 1.0,
    "force_balanced": 1.1,
    "relibra_reorder_no_locality": 1.5,
    "relibra_reorder_only": 1.45,
}
MODELS = ["qwen3-30b-a3b", "qwen3-235b-a22b"]
CLAIMS = {"paper_claims.md", "paper_claims.tex"}
"""The cross-preset claims table, written beside each preset's tables (tests/analysis/test_claims.py)."""
DATASETS = ["reasoning", "mixed"]
CODE = "0.1.0+g0123456789ab"
"""The code version of the test rows (one that names a commit: a version that names no code is refused)."""


def _row(model: str, dataset: str, planner: str, nodes: int, bump: float = 1.0) -> dict:
    step = 10.0 / (FACTOR[planner] * bump)
    return {
        "model": model,
        "dataset": dataset,
        "planner": planner,
        "nodes": nodes,
        "gpus_per_node": 8,
        "replica_slots": 2,
        "tokens": 1_000_000,
        "step_time_s": step,
        "throughput_tokens_per_s": 1e6 / step,
        "skew_mean": SKEW[planner] + 0.01 * nodes,
        "skew_p50": 1.0,
        "skew_p90": 1.0,
        "skew_max": 2.0,
        "plan_time_s": 0.5,
        "replica_buffer_bytes": 18 * 2**20,
        "reorder_moved_experts": 3,
        "t_compute_s": step / 2,
        "t_comm_s": step / 4,
        "t_sync_exposed_s": 0.0,
        "t_reorder_s": 0.2,
        "t_attention_s": step / 4,
        "param_bytes_per_gpu": 6e9,
        "num_batches": 2,
        "code_version": CODE,
    }


def _layers(planner: str, skew: float) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    m, l = np.meshgrid(np.arange(6), np.arange(4), indexing="ij")
    return pd.DataFrame(
        {
            "planner": planner,
            "batch": m.ravel() // 3,
            "micro_batch": m.ravel(),
            "layer": l.ravel(),
            "skew": skew + rng.random(m.size) * 0.1,
        }
    )


def _write(root: Path, name: str, rows: list[dict], layers: bool = False) -> None:
    store = ResultsStore(root / name)
    for i, row in enumerate(rows):
        per_layer = _layers(row["planner"], SKEW[row["planner"]]) if layers else None
        store.write(cell_key({"i": i}), pd.DataFrame([row]), {"i": i}, per_layer)


@pytest.fixture
def results(tmp_path: Path) -> Path:
    core = ["megatron", "popfetcher", "eplb", "lplb", "relibra", "balanced", "force_balanced"]
    overall = [
        _row(m, d, p, 4, bump=1.0 + 0.1 * j) for j, m in enumerate(MODELS) for d in DATASETS for p in core
    ]
    _write(tmp_path, "quick_overall", overall, layers=True)
    abl = [
        _row(m, d, p, 4)
        for m in MODELS
        for d in DATASETS
        for p in ("megatron", "relibra_reorder_no_locality", "relibra_reorder_only", "relibra")
    ]
    _write(tmp_path, "quick_ablation", abl)
    _write(
        tmp_path,
        "quick_ep_scaling",
        [_row("qwen3-30b-a3b", "mixed", p, n) for n in (1, 2, 4, 8) for p in ("megatron", "relibra")],
    )
    _write(
        tmp_path,
        "quick_datasets",
        [_row("qwen3-235b-a22b", d, p, 8) for d in DATASETS for p in ("megatron", "relibra")],
    )
    _write(tmp_path, "quick_overhead", [_row(m, "mixed", "relibra", 4) for m in MODELS])
    return tmp_path


def _frame(root: Path, name: str) -> pd.DataFrame:
    return ResultsStore(root / name).load()


def test_overall_speedups_follow_the_throughputs(results: Path) -> None:
    cells = overall_cells(_frame(results, "quick_overall")).frame
    assert len(cells) == len(MODELS) * len(DATASETS)
    np.testing.assert_allclose(cells["over Megatron-LM"], FACTOR["relibra"] / FACTOR["megatron"])
    np.testing.assert_allclose(cells["over EPLB+"], FACTOR["relibra"] / FACTOR["eplb"])
    np.testing.assert_allclose(cells["% of Balanced"], 100 * FACTOR["relibra"] / FACTOR["balanced"])
    force = 100 * FACTOR["relibra"] / FACTOR["force_balanced"]
    np.testing.assert_allclose(cells["% of force-balanced"], force)
    # the two references side by side, Balanced first (as shown: the spreads sit in their means' cells)
    cols = list(overall_cells(_frame(results, "quick_overall")).formatted().columns)
    assert cols.index("% of force-balanced") == cols.index("% of Balanced") + 1
    summary = overall_summary(_frame(results, "quick_overall")).frame.set_index("against")
    assert summary.loc["of force-balanced", "ours lo"] == pytest.approx(force / 100)
    assert np.isnan(summary.loc["of force-balanced", "paper lo"])
    row = summary.loc["over PopFetcher"]
    lo, hi = paper.OVERALL_SPEEDUP["popfetcher"]
    assert (row["paper lo"], row["paper hi"]) == (lo, hi)
    assert row["ours/paper hi"] == pytest.approx(FACTOR["relibra"] / FACTOR["popfetcher"] / hi)


def test_overall_and_overhead_show_the_paper_and_the_recommended_relibra() -> None:
    planners = {"megatron": 1.0, "relibra_replicate_only": 1.3, "relibra": 1.5, "relibra_portfolio": 1.6}
    rows = []
    for d in DATASETS:
        for p, factor in planners.items():
            row = _row("qwen3-30b-a3b", d, "megatron", 4) | {"planner": p}
            step = 10.0 / factor
            row |= {"step_time_s": step, "throughput_tokens_per_s": 1e6 / step}
            moving = p in ("relibra", "relibra_portfolio")
            row |= {
                "t_reorder_s": {"relibra": 0.5, "relibra_portfolio": 0.1}.get(p, 0.0) * (1 + (d == "mixed")),
                "reorder_moved_experts": 100.0 if p == "relibra" else 10.0 * moving,
                "migration_bytes": 2e9 * moving,
                "layers_kept_share": 0.0 if p == "relibra" else 0.75,
                "layers_kept_share_min": 0.0 if p == "relibra" else 0.5,
            }
            rows.append(row)
    frame = pd.DataFrame(rows)
    cells = overall_cells(frame).frame
    assert list(cells["ReLibra"].unique()) == ["ReLibra (paper)", "ReLibra (recommended)"]
    rec = cells[cells["ReLibra"] == "ReLibra (recommended)"]
    np.testing.assert_allclose(rec["over Megatron-LM"], 1.6)
    np.testing.assert_allclose(rec[f"over {paper.label('relibra_replicate_only')}"], 1.6 / 1.3)
    summary = overall_summary(frame).frame
    assert set(summary["ReLibra"]) == {"ReLibra (paper)", "ReLibra (recommended)"}
    table = overhead(frame).frame.set_index("ReLibra")
    rec_row, paper_row = table.loc["ReLibra (recommended)"], table.loc["ReLibra (paper)"]
    assert rec_row["moved pairs/batch"] == 10.0 and paper_row["moved pairs/batch"] == 100.0
    assert rec_row["moved GB/batch"] == pytest.approx(2.0)
    assert rec_row["layers kept %"] == pytest.approx(75.0) and rec_row["least-kept layer %"] == 50.0
    shares = [100 * 0.1 / (10 / 1.6), 100 * 0.2 / (10 / 1.6)]  # reasoning, mixed
    assert rec_row["reorder % median cell"] == pytest.approx(np.median(shares))
    assert rec_row["reorder % cells"] == f"{min(shares):.2f}-{max(shares):.2f}"
    assert rec_row["reorder % batch"] == pytest.approx(100 * 0.15 / (10 / 1.6))


def test_ablation_is_relative_to_megatron_with_paper_beside(results: Path) -> None:
    table = ablation(_frame(results, "quick_ablation")).frame
    reorder = table[(table["variant"] == paper.label("relibra_reorder_only")) & (table["dataset"] == "mixed")]
    assert reorder["ours (x Megatron-LM)"].item() == pytest.approx(FACTOR["relibra_reorder_only"])
    assert reorder["paper"].item() == paper.ABLATION[("relibra_reorder_only", "mixed")]
    assert reorder["ours/paper"].item() == pytest.approx(1.1 / 1.15)
    # the locality round's own row comes first: placement only, then "+ locality round"
    variants = list(dict.fromkeys(table["variant"]))
    assert variants[:2] == [paper.label("relibra_reorder_no_locality"), paper.label("relibra_reorder_only")]
    assert "+ locality round" in paper.label("relibra_reorder_only")
    placement = table[table["variant"] == paper.label("relibra_reorder_no_locality")]
    np.testing.assert_allclose(placement["ours (x Megatron-LM)"], FACTOR["relibra_reorder_no_locality"])


def test_skew_by_ep_and_range_ratio(results: Path) -> None:
    table = skew_by_ep(_frame(results, "quick_ep_scaling")).frame
    assert list(table["EP"]) == [8, 16, 32, 64]
    np.testing.assert_allclose(table["Megatron-LM"], SKEW["megatron"] + 0.01 * np.array([1, 2, 4, 8]))
    assert range_ratio(1.05, 1.0, 1.08) == 1.0
    assert range_ratio(1.62, 1.0, 1.08) == pytest.approx(1.5)
    assert range_ratio(0.5, 1.0, 1.08) == pytest.approx(0.5)


def test_step_by_ep_is_relative_to_relibra(results: Path) -> None:
    table = step_by_ep(_frame(results, "quick_ep_scaling")).frame
    assert list(table["EP"]) == [8, 16, 32, 64]
    np.testing.assert_allclose(table["ReLibra step s"], 10.0 / FACTOR["relibra"])
    np.testing.assert_allclose(table["Megatron-LM / ReLibra"], FACTOR["relibra"] / FACTOR["megatron"])
    with pytest.raises(ValueError, match="relibra"):
        step_by_ep(_frame(results, "quick_ep_scaling").query("planner != 'relibra'"))


def test_overhead_uses_buffer_params_and_batches(results: Path) -> None:
    table = overhead(_frame(results, "quick_overhead")).frame.set_index("model")
    assert table.loc["qwen3-30b-a3b", "buffer MiB"] == pytest.approx(18.0)
    assert table.loc["qwen3-30b-a3b", "buffer % params"] == pytest.approx(100 * 18 * 2**20 / 6e9)
    assert table.loc["qwen3-30b-a3b", "plan s/batch"] == pytest.approx(0.25)


def test_missing_reference_planner_is_named() -> None:
    frame = pd.DataFrame([_row("m", "d", "relibra", 1)])
    with pytest.raises(ValueError, match="megatron"):
        ablation(frame)


def test_markdown_and_latex_render(results: Path) -> None:
    table = overall_summary(_frame(results, "quick_overall"))
    md = to_markdown(table)
    assert md.count("\n|") == 2 + len(table.frame) and "paper lo" in md
    tex = to_latex(table)
    assert "\\toprule" in tex and "\\caption{" in tex and "ours/paper lo" in tex


def test_cli_writes_tables_and_figures(results: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(results), "--out", str(results / "out")]) == 0
    printed = capsys.readouterr().out
    assert "paper" in printed and "Megatron-LM" in printed
    names = {p.name for p in (results / "out").iterdir()}
    for stem in (
        "quick_overall.overall",
        "quick_overall.overall_cells",
        "quick_ablation.ablation",
        "quick_ep_scaling.skew_by_ep",
        "quick_ep_scaling.step_by_ep",
        "quick_datasets.skew_by_dataset",
        "quick_datasets.step_by_dataset",
        "quick_overhead.overhead",
    ):
        assert {f"{stem}.md", f"{stem}.tex"} <= names
    caption = next(
        line
        for line in (results / "out" / "quick_overall.overall.tex").read_text().splitlines()
        if "caption" in line
    )
    assert "[quick\\_overall]" in caption  # LaTeX specials escaped in the caption too
    figs = {p.name for p in (results / "out" / "figures").iterdir()}
    for stem in (
        "quick_overall.throughput",
        "quick_ablation.ablation",
        "quick_ep_scaling.skew_by_ep",
        "quick_overall.layer_skew",
    ):
        assert {f"{stem}.png", f"{stem}.pdf"} <= figs
    assert all((results / "out" / "figures" / f).stat().st_size > 1000 for f in figs)


def test_partial_grid_skips_what_it_cannot_build_and_keeps_the_rest(tmp_path: Path) -> None:
    _write(tmp_path, "quick_overall", [_row("m", "reasoning", p, 1) for p in ("megatron", "eplb")])
    _write(
        tmp_path,
        "quick_ep_scaling",
        [_row("m", "mixed", p, n) for n in (1, 2) for p in ("megatron", "relibra")],
    )
    out = analyse(tmp_path)
    assert any("quick_overall" in why and "relibra" in why for why in out.skipped)
    assert {p.name for p in out.tables} - CLAIMS == {
        "quick_ep_scaling.skew_by_ep.md",
        "quick_ep_scaling.skew_by_ep.tex",
        "quick_ep_scaling.step_by_ep.md",
        "quick_ep_scaling.step_by_ep.tex",
    }
    assert {p.name for p in out.figures} >= {
        "quick_overall.throughput.png",
        "quick_ep_scaling.skew_by_ep.png",
    }


def test_one_store_can_be_analysed_alone(results: Path) -> None:
    out = analyse(results / "quick_ablation", results / "one")
    assert {p.name for p in out.tables} - CLAIMS == {
        "quick_ablation.ablation.md",
        "quick_ablation.ablation.tex",
    }
    # NOTE: a table over every grid says why it needs other grids; the store's own tables skip nothing
    assert [why for why in out.skipped if not why.startswith("recommended_targets")] == []


def test_empty_results_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no finished cells"):
        analyse(tmp_path)


ONLINE = {"ultraep": 1.35, "llep": 1.15, "relibra_replicate_only": 1.4, "relibra_portfolio": 1.55}


def _online_row(model: str, dataset: str, planner: str, nodes: int) -> dict:
    row = _row(model, dataset, "relibra", nodes)
    step = 10.0 / ONLINE.get(planner, FACTOR.get(planner, 1.0))
    critical = 0.3 if planner in ("ultraep", "llep") else 0.0
    return row | {
        "planner": planner,
        "step_time_s": step,
        "throughput_tokens_per_s": 1e6 / step,
        "t_compute_s": step / 2,
        "t_comm_s": step / 4 - critical,
        "t_critical_path_s": critical,
        "t_attention_s": step / 4 - 0.2,
    }


def test_replay_adds_breaks_step_time_down_against_the_best_online_balancer() -> None:
    from analysis.tables import replay_adds

    planners = ["megatron", "ultraep", "llep", "relibra_replicate_only", "relibra", "relibra_portfolio"]
    frame = pd.DataFrame([_online_row("qwen3-30b-a3b", "mixed", p, n) for n in (1, 8) for p in planners])
    table = replay_adds(frame).frame
    assert set(table["planner"]) == {paper.label(p) for p in planners[1:]}  # Megatron-LM is not in it
    assert list(table["EP"].unique()) == [8, 64]
    first = table[table["EP"] == 8]
    labels = ["ReLibra (paper)", "+ intra-batch replication only", "ReLibra (recommended)"]
    assert list(first["planner"])[:3] == labels
    relibra = first.set_index("planner").loc["ReLibra (paper)"]
    assert relibra["x best online"] == pytest.approx(FACTOR["relibra"] / ONLINE["ultraep"])
    assert relibra["critical path s"] == 0.0
    ultra = first.set_index("planner").loc["UltraEP"]
    assert ultra["critical path s"] == pytest.approx(0.3) and ultra["x best online"] == pytest.approx(1.0)
    terms = ["compute s", "comm s", "attention s", "critical path s", "refill s", "migration s"]
    np.testing.assert_allclose(first[terms].sum(axis=1), first["step s"])
    with pytest.raises(ValueError, match=r"one of \['ultraep', 'llep', 'moonep'\]"):
        replay_adds(frame[~frame["planner"].isin(["ultraep", "llep"])])


def test_ultraep_headline_needs_force_balanced_and_compares_with_its_paper() -> None:
    from analysis.tables import ultraep_headline

    rows = [
        _online_row(m, d, p, 8)
        for m in ("qwen3-235b-a22b", "glm4.5-106b-a12b")
        for d in DATASETS
        for p in ("megatron", "ultraep", "balanced")
    ]
    frame = pd.DataFrame(rows)
    with pytest.raises(ValueError, match="force_balanced"):
        ultraep_headline(frame)
    forced = [
        _online_row(r["model"], r["dataset"], "megatron", 8) for r in rows if r["planner"] == "megatron"
    ]
    forced = [r | {"planner": "force_balanced", "throughput_tokens_per_s": 1e6 / 7.0} for r in forced]
    table = ultraep_headline(pd.concat([frame, pd.DataFrame(forced)])).frame
    assert len(table) == 2 * len(DATASETS) + 1 and table["model"].iloc[-1] == "mean"
    np.testing.assert_allclose(table["% of force-balanced"], 100 * 7.0 / (10.0 / ONLINE["ultraep"]))
    np.testing.assert_allclose(table["over Megatron-LM"], ONLINE["ultraep"])
    np.testing.assert_allclose(table["x ours/paper"], ONLINE["ultraep"] / 1.42)
    assert (table["paper %"] == 94.6).all() and (table["NVLink domain"] == "8 GPUs").all()
    # The same cells in one 64-GPU NVLink domain (nvl72's trays of 4): a block and a mean of their own.
    rack = pd.concat([frame, pd.DataFrame(forced)]).assign(gpus_per_node=4, nodes=16, nvl_domain=64)
    both = ultraep_headline(pd.concat([frame, pd.DataFrame(forced), rack])).frame
    means = both[both["model"] == "mean"]
    assert len(both) == 2 * (2 * len(DATASETS) + 1) and means["NVLink domain"].tolist() == [
        "64 GPUs",
        "8 GPUs",
    ]


def test_step_breakdown_figure(tmp_path: Path) -> None:
    from analysis.figures import plot_step_breakdown, save

    planners = ["megatron", "ultraep", "llep", "relibra", "relibra_portfolio"]
    frame = pd.DataFrame([_online_row("qwen3-30b-a3b", "mixed", p, n) for n in (1, 8) for p in planners])
    fig = plot_step_breakdown(frame)
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 4 * 6  # 4 planners x 6 stacked terms
    assert all(p.stat().st_size > 1000 for p in save(fig, tmp_path, "breakdown"))
    with pytest.raises(ValueError, match=r"one of \['ultraep', 'llep', 'moonep'\]"):
        plot_step_breakdown(frame[frame["planner"].isin(["relibra", "megatron"])])


def _write_named(root: Path, folder: str, experiment: str, rows: list[dict]) -> None:
    store = ResultsStore(root / folder)
    for i, row in enumerate(rows):
        config = {"i": i, "experiment_name": experiment}
        store.write(cell_key(config), pd.DataFrame([row]), config)


def test_store_in_a_folder_not_named_after_its_preset_gets_its_tables(tmp_path: Path) -> None:
    rows = [_row(m, d, p, 4) for m in MODELS for d in DATASETS for p in ("megatron", "relibra_reorder_only")]
    _write_named(tmp_path, "my-copy", "quick_ablation", rows)
    out = analyse(tmp_path / "my-copy", tmp_path / "out")
    assert {p.name for p in out.tables} - CLAIMS == {
        "quick_ablation.ablation.md",
        "quick_ablation.ablation.tex",
    }


def test_store_of_no_known_preset_is_reported_and_the_cli_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "mystore", [_row("m", "reasoning", p, 1) for p in ("megatron", "relibra")])
    assert main([str(tmp_path / "mystore"), "--out", str(tmp_path / "out")]) == 1
    printed = capsys.readouterr().out
    assert "mystore: no tables: not a known experiment" in printed


def test_one_planner_preset_writes_no_empty_table(tmp_path: Path) -> None:
    _write(tmp_path, "quick_overall", [_row(m, "reasoning", "relibra", 4) for m in MODELS])
    out = analyse(tmp_path)
    assert not [p for p in out.tables if p.name.startswith("quick_overall.overall.")]
    assert any("quick_overall: overall_summary skipped" in why for why in out.skipped), out.skipped


def _mixed_rows(second: str = "0.1.0+gb") -> list[dict]:
    return [{**_row(m, d, p, 4), "code_version": "0.1.0+ga" if m == MODELS[0] else second} for m in MODELS
            for d in DATASETS for p in ("megatron", "relibra_reorder_only", "relibra")]  # fmt: skip


def test_mixed_code_versions_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, "quick_ablation", _mixed_rows())
    _write(tmp_path, "quick_overhead", [{**_row(m, "mixed", "relibra", 4), "code_version": "0.1.0+ga"}
                                        for m in MODELS])  # fmt: skip
    out = analyse(tmp_path)
    assert len(out.refused) == 1, out.refused
    why = out.refused[0]
    assert why.startswith("quick_ablation:") and "2 code versions" in why, why
    assert "0.1.0+ga" in why and "0.1.0+gb" in why and "identical_versions.json" in why, why
    assert not [p for p in out.tables if p.name.startswith("quick_ablation.")]
    assert [p for p in out.tables if p.name.startswith("quick_overhead.")]  # one version: built
    assert main([str(tmp_path), "--out", str(tmp_path / "a")]) == 1


def test_versions_shown_identical_are_allowed(tmp_path: Path) -> None:
    import json

    _write(tmp_path, "quick_ablation", _mixed_rows())
    groups = {"groups": [{"versions": ["0.1.0+ga", "0.1.0+gb"], "evidence": "pinned cells identical"}]}
    (tmp_path / "identical_versions.json").write_text(json.dumps(groups))
    out = analyse(tmp_path)
    assert not out.refused
    md = next(p for p in out.tables if p.name == "quick_ablation.ablation.md").read_text()
    assert "`0.1.0+ga` (6 rows)" in md and "`0.1.0+gb` (6 rows)" in md, md


def test_a_third_version_outside_the_identical_group_is_refused(tmp_path: Path) -> None:
    import json

    rows = _mixed_rows() + [{**_row(MODELS[0], "coding", p, 4), "code_version": "0.1.0+gc"}
                            for p in ("megatron", "relibra")]  # fmt: skip
    _write(tmp_path, "quick_ablation", rows)
    groups = {"groups": [{"versions": ["0.1.0+ga", "0.1.0+gb"], "evidence": "pinned cells identical"}]}
    (tmp_path / "identical_versions.json").write_text(json.dumps(groups))
    out = analyse(tmp_path)
    assert out.refused and "3 code versions" in out.refused[0], out.refused


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("{", "not JSON"),
        ('{"groups": 1}', "'groups'"),
        ('{"groups": [{"versions": ["a"], "evidence": "x"}]}', "groups[0].versions"),
        ('{"groups": [{"versions": ["a", "b"]}]}', "groups[0].evidence"),
    ],
)
def test_bad_identical_versions_file_is_refused_with_exit_2(
    tmp_path: Path, text: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _write(tmp_path, "quick_ablation", _mixed_rows())
    (tmp_path / "identical_versions.json").write_text(text)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "identical_versions.json" in err and named in err, err


def test_every_table_states_its_cells_version_and_command(results: Path) -> None:
    out = analyse(results, command="python -m experiments.reproduce --scale quick")
    for path in out.tables:
        text = path.read_text().replace("`", "")  # NOTE: the LaTeX caption drops Markdown's code marks
        assert f"Provenance: cells computed by {CODE}" in text, path
        assert "python -m experiments.reproduce --scale quick at 0.1.0" in text, path


def test_unreadable_cell_is_warned_about_and_left_out(tmp_path: Path) -> None:
    rows = [_row(m, d, p, 4) for m in MODELS for d in DATASETS for p in ("megatron", "relibra")]
    _write(tmp_path, "quick_ablation", rows)
    victim = ResultsStore(tmp_path / "quick_ablation").cell_path(cell_key({"i": 0}))
    with open(victim, "r+b") as fh:
        fh.truncate(1000)
    out = analyse(tmp_path)  # not an ArrowInvalid about a '<Buffer>'
    assert any(str(victim) in w and "unreadable" in w for w in out.warnings), out.warnings
    assert out.tables


def test_a_grid_with_unfinished_cells_is_warned_about(tmp_path: Path, capsys) -> None:
    """An interrupted grid (grid.json names cells with no file): the tables are built from the finished
    cells and the reader is told how many of the grid's cells they cover; a complete grid warns nothing."""
    rows = [_row(m, d, p, 4) for m in MODELS for d in DATASETS for p in ("megatron", "relibra")]
    _write(tmp_path, "quick_ablation", rows)
    store = ResultsStore(tmp_path / "quick_ablation")
    store.write_grid(store.keys())
    assert not analyse(tmp_path / "quick_ablation").warnings
    store.write_grid([*store.keys(), "0123456789abcdef", "fedcba9876543210"])
    out = analyse(tmp_path / "quick_ablation", console=Console(width=200))
    n = len(store.keys())
    expected = (
        f"quick_ablation: 2 of the {n + 2} cells of its grid are not finished (an interrupted or running "
        f"grid): its tables cover the {n} finished ones"
    )
    assert [w for w in out.warnings if "not finished" in w] == [f"{expected}; a rerun completes it"]
    assert expected in capsys.readouterr().out and out.tables


def test_comm_sensitivity_pivots_dispatcher_and_overlap() -> None:
    from analysis.tables import comm_sensitivity

    rows = []
    for dispatcher in ("alltoall", "deepep"):
        for overlap in (False, True):
            for planner, step in (("megatron", 4.0), ("relibra", 3.2), ("balanced", 2.0)):
                scale = (0.8 if dispatcher == "deepep" else 1.0) * (0.75 if overlap else 1.0)
                rows.append(
                    _row("qwen3-30b-a3b", "mixed", planner, 4)
                    | {"step_time_s": step * scale, "dispatcher": dispatcher, "ep_overlap": overlap}
                )
    table = comm_sensitivity(pd.DataFrame(rows)).frame
    assert list(table["dispatcher"]) == ["alltoall", "alltoall", "deepep", "deepep"]
    assert list(table["overlap"]) == ["off", "on", "off", "on"]
    np.testing.assert_allclose(table["ReLibra over Megatron-LM"], 1.25)
    np.testing.assert_allclose(table["Megatron-LM s"], [4.0, 3.0, 3.2, 2.4])
    with pytest.raises(ValueError, match="dispatcher"):
        comm_sensitivity(pd.DataFrame(rows).drop(columns="dispatcher"))


def test_comm_sensitivity_takes_each_ratio_per_seed_with_its_spread_and_ties() -> None:
    from analysis.tables import comm_sensitivity

    rows = []
    # seed 0: ReLibra 1.25x faster than Megatron-LM; seed 1: 0.9x (slower), so the ratio is a tie
    for seed, relibra in ((0, 3.2), (1, 4.0 / 0.9)):
        for planner, step in (("megatron", 4.0), ("relibra", relibra)):
            rows.append(
                _row("qwen3-30b-a3b", "mixed", planner, 4)
                | {"step_time_s": step, "dispatcher": "deepep", "ep_overlap": False, "seed": seed}
            )
    table = comm_sensitivity(pd.DataFrame(rows))
    frame = table.frame
    np.testing.assert_allclose(frame["ReLibra over Megatron-LM"], (1.25 + 0.9) / 2)  # per seed, then mean
    np.testing.assert_allclose(frame["ReLibra over Megatron-LM min"], 0.9)
    np.testing.assert_allclose(frame["ReLibra over Megatron-LM max"], 1.25)
    np.testing.assert_allclose(frame["ReLibra (paper) s"], (3.2 + 4.0 / 0.9) / 2)
    assert "ReLibra over Megatron-LM" in table.ties and "2 seeds" in table.note
    assert "tie" in table.formatted()["ReLibra over Megatron-LM"].iloc[0]


def test_loaded_results_carry_each_cells_dispatcher_and_overlap(tmp_path: Path) -> None:
    from analysis.load import load_results
    from experiments.store.results_store import ResultsStore

    store = ResultsStore(tmp_path / "comm_sensitivity")
    configs = {
        "a": {"experiment_name": "comm_sensitivity", "cluster": {"dispatcher": "deepep", "ep_overlap": True}},
        "b": {"experiment_name": "comm_sensitivity", "cluster": {}},  # a cell from before the keys existed
    }
    for config in configs.values():
        store.write(cell_key(config), pd.DataFrame([_row("qwen3-30b-a3b", "mixed", "relibra", 1)]), config)
    frame = load_results(tmp_path)["comm_sensitivity"].set_index("cell")
    frame = frame.rename(index={cell_key(config): name for name, config in configs.items()})
    assert (frame.loc["a", "dispatcher"], bool(frame.loc["a", "ep_overlap"])) == ("deepep", True)
    assert (frame.loc["b", "dispatcher"], bool(frame.loc["b", "ep_overlap"])) == ("alltoall", False)


def test_skew_and_overhead_show_their_spread_over_seeds() -> None:
    # Two trace seeds whose skewness and migration differ: the tables give the mean and the min-max beside it.
    rows = []
    for seed, (bump, reorder) in enumerate(((0.0, 0.2), (0.1, 0.4))):
        for planner in ("megatron", "relibra"):
            row = _row("qwen3-30b-a3b", "mixed", planner, 2) | {"seed": seed, "t_reorder_s": reorder}
            rows.append(row | {"skew_mean": row["skew_mean"] + bump})
    frame = pd.DataFrame(rows)
    skew = skew_by_ep(frame)
    got = skew.frame.set_index("EP")
    assert got.loc[16, "ReLibra (paper)"] == pytest.approx(SKEW["relibra"] + 0.02 + 0.05)
    assert (got.loc[16, "ReLibra (paper) min"], got.loc[16, "ReLibra (paper) max"]) == pytest.approx(
        (SKEW["relibra"] + 0.02, SKEW["relibra"] + 0.12)
    )
    text = skew.formatted().set_index("EP").loc["16", "ReLibra (paper)"]
    assert text == f"{SKEW['relibra'] + 0.07:.3f} ({SKEW['relibra'] + 0.02:.3f}-{SKEW['relibra'] + 0.12:.3f})"
    assert "2 seeds" in skew.note
    table = overhead(frame)
    step = 10.0 / FACTOR["relibra"]
    rel = table.frame.set_index("ReLibra").loc[paper.label("relibra")]
    assert rel["reorder % batch"] == pytest.approx(100 * 0.3 / step)
    assert (rel["reorder % batch min"], rel["reorder % batch max"]) == pytest.approx(
        (100 * 0.2 / step, 100 * 0.4 / step)
    )
    assert "(" in table.formatted().set_index("ReLibra").loc[paper.label("relibra"), "reorder % batch"]


@pytest.mark.parametrize("version", ["0.1.0", "unknown", None])
def test_cells_whose_version_names_no_code_are_refused_not_taken_as_one_version(
    tmp_path: Path, version: str | None
) -> None:
    """``0.1.0`` (what a checkout git refused used to record) or no version: two such cells may come from
    different code, so the preset gets no tables, even when every cell reads the same."""
    rows = [{**_row(m, "mixed", "relibra", 4), "code_version": version} for m in MODELS]
    if version is None:
        rows = [{k: v for k, v in row.items() if k != "code_version"} for row in rows]
    _write(tmp_path, "quick_overhead", rows)
    out = analyse(tmp_path)
    assert len(out.refused) == 1 and out.refused[0].startswith("quick_overhead: tables refused"), out.refused
    assert f"2 rows by {version or 'unknown'}" in out.refused[0] and "names no code" in out.refused[0]
    assert not [p for p in out.tables if p.name.startswith("quick_overhead.")]


def test_a_refused_preset_loses_its_earlier_tables_and_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's probe: tables and figures of an earlier run must not pass for the refused preset's, and no
    figure (the per-layer heatmap included) is drawn from its mixed cells; exit 1."""
    core = ["megatron", "popfetcher", "eplb", "lplb", "relibra", "balanced", "force_balanced"]
    rows = [_row(m, d, p, 4) for m in MODELS for d in DATASETS for p in core]
    _write(tmp_path, "quick_overall", rows, layers=True)
    out_dir = tmp_path / "out"
    assert main([str(tmp_path), "--out", str(out_dir)]) == 0
    before = {p.name for p in out_dir.rglob("quick_overall.*")}
    assert "quick_overall.layer_skew.png" in before and "quick_overall.throughput.png" in before, before
    store = ResultsStore(tmp_path / "quick_overall")
    key = store.keys()[0]
    store.write(key, store.read(key).assign(code_version="0.1.0+gother"), store.config(key))
    assert main([str(tmp_path), "--out", str(out_dir)]) == 1
    text = capsys.readouterr().out
    assert "quick_overall: tables refused" in text and "removed" in text, text
    assert not list(out_dir.rglob("quick_overall.*")), sorted(p.name for p in out_dir.rglob("*"))
    assert not list(out_dir.glob("headline.*"))  # NOTE: drawn from quick_overall


def test_a_lost_per_layer_table_skips_the_per_layer_figures_with_why(tmp_path: Path) -> None:
    """The issue's probe: a deleted ``per_layer/<key>.parquet`` must not give a heatmap without that
    planner, silently."""
    core = ["megatron", "popfetcher", "eplb", "lplb", "relibra", "balanced", "force_balanced"]
    _write(
        tmp_path, "quick_overall", [_row(m, d, p, 4) for m in MODELS for d in DATASETS for p in core], True
    )
    store = ResultsStore(tmp_path / "quick_overall")
    lost = store.keys()[0]
    store.per_layer_path(lost).unlink()
    out = analyse(tmp_path, tmp_path / "out")
    assert not list((tmp_path / "out").rglob("quick_overall.layer_skew.*"))
    assert any(f"per_layer/{lost}.parquet" in why and "skipped" in why for why in out.skipped), out.skipped
    assert [p for p in out.tables if p.name.startswith("quick_overall.")]  # the rows are whole
