"""Intra-batch replication: the incremental greedy (greedy.py: the public API; its numba core in links.py,
state.py, moves.py and search.py), the MILP and LP split (milp.py) and the terms they share (terms.py)."""
