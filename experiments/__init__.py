"""The Hydra experiment app, its config groups and the results store."""
