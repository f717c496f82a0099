"""Executors that run plans: the simulator lives in relibra.simulator; real ones here."""
