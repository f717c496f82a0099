"""Hydra plugin: the basic sweeper with the suite's config checks run on every cell before any cell runs."""
