# `make reproduce` and `make test` create the virtual environment when needed (torch pinned first, so
# pip takes the CPU wheel instead of a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes (pytest-xdist): one per core; a file's tests stay in one process (their fixtures are built once).
TEST_WORKERS ?= auto

.PHONY: venv test test-slow test-verl test-megatron reproduce reproduce-quick-field reproduce-paper reproduce-field lint typecheck bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,megatron,capture,mbridge]'
	touch $(STAMP)

venv: $(STAMP)

# Lint and types first (cheap), then the suite. pytest exits 5 when no test ran: that must fail, never pass.
test: venv lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests ran" >&2; exit 1; fi; exit $$rc

# The verl tests (tests/integrations, the verl fixtures of tests/trace/test_importers_rl.py) skip here:
# verl lives in its own environment (`make test-verl`; docs/integrations.md says why).
test-slow: venv
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

# verl pins transformers<5.11 and brings ray, so it gets a separate environment (torch pinned first).
VERL_VENV ?= .venv-verl
test-verl:
	test -x $(VERL_VENV)/bin/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VERL_VENV)/bin/python -m pip install -q -e '.[dev,verl]'
	$(VERL_VENV)/bin/python -m pytest -q -m "slow or not slow" tests/integrations tests/trace/test_importers_rl.py $(PYTEST_ARGS)

# megatron-core 0.19.2 (what Megatron-Bridge, verl's and NeMo-RL's Megatron back ends run) needs Python >= 3.12,
# so it gets its own environment beside the default one's 0.16.1 (docs/megatron.md). torch is pinned first,
# as above: no CPU build of torch 2.13.0 for 3.12 lies on disk, so pip downloads the CUDA build from PyPI
# (it runs on the CPU). Python: pyenv's 3.12 when installed, else python3.12 on PATH.
MEGATRON_VENV ?= .venv-megatron
MEGATRON_PYTHON ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),python3.12)
MEGATRON_PY := $(MEGATRON_VENV)/bin/python
MEGATRON_STAMP := $(MEGATRON_VENV)/.installed
MEGATRON_TESTS ?= tests/executors/test_megatron.py

$(MEGATRON_STAMP): pyproject.toml
	@$(MEGATRON_PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "make test-megatron: MEGATRON_PYTHON=$(MEGATRON_PYTHON) is Python %d.%d; megatron-core 0.19.2 needs >= 3.12" % sys.version_info[:2])'
	test -x $(MEGATRON_PY) || $(MEGATRON_PYTHON) -m venv $(MEGATRON_VENV)
	$(MEGATRON_PY) -m pip install -q --upgrade pip
	$(MEGATRON_PY) -m pip install -q torch==2.13.0
	$(MEGATRON_PY) -m pip install -q -e '.[dev,megatron19]'
	touch $(MEGATRON_STAMP)

test-megatron: $(MEGATRON_STAMP)
	$(MEGATRON_PY) -m pytest -q -m megatron $(MEGATRON_TESTS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-megatron: no tests ran" >&2; exit 1; fi; exit $$rc

reproduce: venv
	$(PY) -m experiments.reproduce

# The grids beyond the paper at the quick scale: DeepEP, NVL72, the whole-step shift, the dispatcher and
# overlap sensitivity, Megatron-LM's token-imbalance workloads.
reproduce-quick-field: venv
	$(PY) -m experiments.reproduce --scale quick-field

# The paper's six grids at its scale (4 RL steps of 512 rollouts instead of 1), three trace seeds.
reproduce-paper: venv
	$(PY) -m experiments.reproduce --scale paper

# The grids beyond the paper at its scale: DeepEP (the headline's second row), NVL72, the dispatcher and
# overlap sensitivity. Into the same results/, so the analysis draws both dispatchers.
reproduce-field: venv
	$(PY) -m experiments.reproduce --scale field

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: venv
	$(PY) -m mypy relibra baselines experiments analysis benchmarks scripts

clean:
	rm -rf $(VENV) $(VERL_VENV) $(MEGATRON_VENV) outputs multirun .pytest_cache .mypy_cache .ruff_cache
