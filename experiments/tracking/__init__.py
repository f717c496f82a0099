"""Experiment tracking of a finished run (``logger=wandb``): Weights & Biases sees only what the run has
already written to disk.

The package's place among the others: docs/architecture.md, "Where the code lives".
"""
