"""Hooks that put ReLibra inside RL trainers (docs/integrations.md).

Each integration is a thin module that imports its trainer lazily and translates at the boundary: no
trainer type reaches the core, and the core never needs a trainer installed. ``verl`` is the first
(:mod:`relibra.integrations.verl`); :mod:`relibra.integrations.layout` holds the sample layout of trainers
whose micro-batches hold a fixed number of samples.
"""
