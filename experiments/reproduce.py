"""``python -m experiments.reproduce`` (``make reproduce``): every cell of the chosen presets, then the
tables.

The command's options and examples: :mod:`experiments.grid.cli`; the runner it drives:
:mod:`experiments.grid.runner` (docs/architecture.md, "Where the code lives").
"""

from experiments.grid.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
