"""Inter-batch reordering: the annealer (anneal.py), its link state (links.py), the locality round
(locality.py) and the exact references (exact.py)."""
