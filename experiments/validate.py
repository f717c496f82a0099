"""``python -m experiments.validate``: the cost model beside published measurements (kernels, one MoE layer,
the whole step, the imbalance penalty).

The command's options: :mod:`experiments.validation.cli`; what each mode compares: the modules of
:mod:`experiments.validation` (docs/architecture.md, "Where the code lives").
"""

from experiments.validation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
