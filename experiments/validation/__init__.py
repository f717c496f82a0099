"""The cost model beside published measurements, ``python -m experiments.validate``: kernels (DeepEP,
DeepGEMM, DeepSeek-V3's profile), one MoE layer, the whole training step and the imbalance penalty, each from
a committed file under ``experiments/data`` that names its source.

The package's place among the others: docs/architecture.md, "Where the code lives"; the method:
docs/validation.md.
"""
