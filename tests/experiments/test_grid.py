"""experiments.grid.compose_cells: cells that differ only in their trace seed share one Hydra composition,
and get exactly the config that Hydra composes for each."""

from __future__ import annotations

from omegaconf import OmegaConf

from experiments.grid import cells, compose_cell, compose_cells
from experiments.store import cell_key


def test_seed_copies_equal_hydras_own_composition() -> None:
    grid = cells("overall", ["model=qwen3-30b-a3b", "trace.preset=mixed", "planner=megatron,relibra"])
    assert {dict(o.split("=", 1) for o in cell)["seed"] for cell in grid} == {"0", "1", "2"}
    shared = compose_cells("overall", grid)
    for cell, cfg in zip(grid, shared, strict=True):
        own = compose_cell("overall", cell)
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(own)
        assert OmegaConf.to_yaml(cfg, resolve=True) == OmegaConf.to_yaml(own, resolve=True)
        assert OmegaConf.is_struct(cfg) == OmegaConf.is_struct(own)
        assert cell_key(cfg) == cell_key(own)
    # NOTE: copies, never one object: a cell's config changed later must not change another's
    assert len({id(cfg) for cfg in shared}) == len(shared)
    assert [cfg.seed for cfg in shared] == [int(dict(o.split("=", 1) for o in c)["seed"]) for c in grid]


def test_cells_without_one_seed_override_are_composed_each() -> None:
    grid = [["model=qwen3-30b-a3b"], ["model=qwen3-30b-a3b", "seed=4"], ["model=qwen3-30b-a3b", "seed=5"]]
    for cell, cfg in zip(grid, compose_cells("overall", grid), strict=True):
        assert OmegaConf.to_yaml(cfg) == OmegaConf.to_yaml(compose_cell("overall", cell))
