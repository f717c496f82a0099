"""The run's configuration: composing it from the Hydra config groups under ``experiments/conf`` (one cell or
a preset's grid of cells), checking every key before any work, and building the library's objects from it.

The package's place among the others: docs/architecture.md, "Where the code lives".
"""

from experiments.config.resolvers import register

register()  # NOTE: ${default:KEY} in the yaml resolves wherever a run config is composed
