"""The main job, ``python -m experiments.reproduce``: every preset's cells planned against its results store,
computed in worker processes, shown as progress, and followed by the analysis.

The package's place among the others: docs/architecture.md, "Where the code lives".
"""
