"""The results store: one verified parquet file per grid cell under its cell key, the run directory a run
writes whole or not at all, and the trace digest that keys a cell by its routing.

The package's place among the others: docs/architecture.md, "Where the code lives"; the store's layout and
guarantees: docs/results_store.md.
"""
