"""The Hydra experiment app (``python -m experiments.run``) and the packages around it, one job each:
``config`` (compose and check a run's config), ``store`` (the results store), ``grid`` (the main job,
``python -m experiments.reproduce``), ``validation`` (``python -m experiments.validate``), ``tracking``
(W&B); the map: docs/architecture.md, "Where the code lives"."""

from experiments.interrupt import quiet_interrupt as _quiet_interrupt

_quiet_interrupt()  # NOTE: before the seconds of imports below; only under ``python -m experiments.<module>``

from experiments.config.planner_nodes import register as _register_planner_nodes  # noqa: E402

_register_planner_nodes()
