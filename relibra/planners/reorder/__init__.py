"""Inter-batch reordering: the annealer (anneal.py: AnnealingReorderer; its settings in config.py, one
layer's problem in problem.py, its numba kernels in kernels.py, its link state in links.py), the locality
round (locality.py) and the exact references (exact.py)."""
