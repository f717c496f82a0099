"""Intra-batch replication: the incremental greedy (greedy.py), the MILP and LP split (milp.py) and the
terms they share (terms.py)."""
