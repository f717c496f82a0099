"""The Hydra experiment app, its config groups and the results store."""

from experiments.planner_nodes import register as _register_planner_nodes

_register_planner_nodes()
