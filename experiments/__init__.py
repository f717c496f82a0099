"""The Hydra experiment app, its config groups and the results store."""

from experiments.interrupt import quiet_interrupt as _quiet_interrupt

_quiet_interrupt()  # NOTE: before the seconds of imports below; only under ``python -m experiments.<module>``

from experiments.planner_nodes import register as _register_planner_nodes  # noqa: E402

_register_planner_nodes()
