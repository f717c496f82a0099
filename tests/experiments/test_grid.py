"""experiments.config.presets.compose_cells: one Hydra composition per preset (and per group option its cells
choose), each cell a copy with its overrides set, gives every cell exactly the config Hydra composes for
it."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException, HydraException
from omegaconf import DictConfig, OmegaConf

from experiments.config import presets as grid_module
from experiments.config.errors import ConfigError
from experiments.config.presets import cells, compose_cell, compose_cells, expand
from experiments.config.spec import RunSpec, build_spec
from experiments.grid.runner import QUICK_FIELD_PRESETS, QUICK_PRESETS
from experiments.store.keys import cell_key


def _same(fast: DictConfig, hydra: DictConfig) -> None:
    assert OmegaConf.to_yaml(fast) == OmegaConf.to_yaml(hydra)  # NOTE: key order and interpolations too
    assert OmegaConf.to_container(fast) == OmegaConf.to_container(hydra)
    assert OmegaConf.to_yaml(fast, resolve=True) == OmegaConf.to_yaml(hydra, resolve=True)
    assert OmegaConf.is_struct(fast) == OmegaConf.is_struct(hydra)
    spec = _spec(fast)  # NOTE: the typed path: the same spec (or the same refusal), keyed as the composition
    assert spec == _spec(hydra)
    if isinstance(spec, RunSpec):
        assert spec.composed == OmegaConf.to_container(hydra, resolve=True)
    if fast.trace.get("path") is None:  # NOTE: a trace file's key reads the file (equal configs: equal keys)
        assert cell_key(fast) == cell_key(hydra)
        assert not isinstance(spec, RunSpec) or cell_key(spec.composed) == cell_key(hydra)


def _spec(cfg: DictConfig) -> RunSpec | str:
    """The run spec of ``cfg``, or why it has none (``~dump_plans`` leaves out a key the spec needs)."""
    try:
        return build_spec(cfg)
    except ConfigError as exc:
        return str(exc)


def _covering(grid: list[list[str]]) -> list[list[str]]:
    """The first and last cell, and for every override value of the grid a cell that has it."""
    chosen = [grid[0], grid[-1]]
    seen = {o for cell in chosen for o in cell}
    for cell in grid:
        if any(o not in seen for o in cell):
            chosen.append(cell)
            seen.update(cell)
    return chosen


def _both_ways(preset: str, grid: list[list[str]]) -> None:
    grid = [[*cell, f"results_dir=/nonexistent/{preset}"] for cell in grid]  # NOTE: as plan_grid adds it
    for cell, cfg in zip(grid, compose_cells(preset, grid), strict=True):
        _same(cfg, compose_cell(preset, cell))


@pytest.mark.parametrize("preset", ["quick_comm_sensitivity", "quick_nvl72", "quick_peer"])
def test_every_option_of_a_quick_preset_composes_as_hydra_does(preset: str) -> None:
    """Group options (model, planner), plain keys of every type (ints, strings, booleans), a cluster
    chosen in the preset's defaults and a preset's own node (peer.ep): the rest under -m slow."""
    _both_ways(preset, _covering(cells(preset)))


@pytest.mark.slow
@pytest.mark.parametrize("preset", QUICK_PRESETS + QUICK_FIELD_PRESETS)
def test_every_cell_of_each_quick_preset_composes_as_hydra_does(preset: str) -> None:
    _both_ways(preset, cells(preset))


def test_a_preset_is_composed_once_and_once_per_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """quick_comm_sensitivity: 40 cells, 5 planners (megatron the preset's own) -> 1 + 5 compositions."""
    composed: list[list[str]] = []
    real = grid_module._Composer._compose

    def counting(self: grid_module._Composer, overrides: list[str]) -> DictConfig:
        composed.append(list(overrides))
        return real(self, overrides)

    monkeypatch.setattr(grid_module._Composer, "_compose", counting)
    grid = cells("quick_comm_sensitivity")
    assert len(compose_cells("quick_comm_sensitivity", grid)) == len(grid) == 40
    assert len(composed) == 6 and all(len(o) <= 1 for o in composed)


def test_seeds_and_sweeps_beside_the_preset_compose_as_hydra_does() -> None:
    grid = cells("overall", ["model=qwen3-30b-a3b", "trace.preset=mixed", "planner=megatron,relibra"])
    assert {dict(o.split("=", 1) for o in cell)["seed"] for cell in grid} == {"0", "1", "2"}
    shared = compose_cells("overall", grid)
    for cell, cfg in zip(grid, shared, strict=True):
        _same(cfg, compose_cell("overall", cell))
    # NOTE: copies, never one object: a cell's config changed later must not change another's
    assert len({id(cfg) for cfg in shared}) == len(shared)
    assert len({id(cfg.planner) for cfg in shared}) == len(shared)
    assert [cfg.seed for cfg in shared] == [int(dict(o.split("=", 1) for o in c)["seed"]) for c in grid]


def test_what_a_copy_does_not_reproduce_is_composed_by_hydra() -> None:
    """``++key``, ``~key``, a nested group and a key Hydra refuses: Hydra's own composition and errors."""
    grid = [
        ["model=qwen3-30b-a3b"],
        ["model=qwen3-30b-a3b", "++seed=4"],
        ["planner=relibra", "~dump_plans"],
        ["planner=relibra", "planner/reorder=anneal"],
        ["seed=5", "planner=relibra", "model=glm4.5-106b-a12b"],
    ]
    for cell, cfg in zip(grid, compose_cells("overall", grid), strict=True):
        _same(cfg, compose_cell("overall", cell))
    with pytest.raises(ConfigCompositionException, match=r"cluster\.nodez"):
        compose_cells("overall", [["cluster.nodez=1"]])


def test_a_sweep_expands_as_hydras_basic_sweeper_does() -> None:
    """Each key in its first place with its last value, then the cartesian product in that order (Hydra's
    BasicSweeper.split_arguments, which expand re-does on the public override parser)."""
    params = {"model": "a,b", "seed": "0"}
    assert expand(params, ["seed=1,2", "+extra=x", "~logger"]) == [
        ["model=a", "seed=1", "+extra=x", "~logger=null"],
        ["model=a", "seed=2", "+extra=x", "~logger=null"],
        ["model=b", "seed=1", "+extra=x", "~logger=null"],
        ["model=b", "seed=2", "+extra=x", "~logger=null"],
    ]
    assert expand({}, ["planner=megatron", "planner=relibra,eplb"]) == [["planner=relibra"], ["planner=eplb"]]
    assert expand({}, ["seed=range(0,3)"]) == [["seed=0"], ["seed=1"], ["seed=2"]]
    with pytest.raises(HydraException, match="seed"):
        expand({}, ["seed=interval(0,1)"])
