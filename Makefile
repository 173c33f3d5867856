# The two commands a new user needs: `make demo` and `make test`. Both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-gpu unit demo lint clean-ray
setup:
	@bash scripts/setup.sh

# tests/multinode and tests/headft each join a cluster of their own, so each runs in a pytest
# session of its own. Then the GPU smoke in its CPU mode (docs/gpu.md), so that its plumbing is
# tested on every change.
test: setup
	$(PY) -m pytest -q -rs --durations=10 $(PYTEST_ARGS)
	$(PY) -m pytest -q -rs tests/multinode $(PYTEST_ARGS)
	$(PY) -m pytest -q -rs tests/headft $(PYTEST_ARGS)
	PY=$(PY) bash scripts/gpu_smoke.sh --device cpu

# On a CUDA host, with no setup (`make setup` installs the CPU builds): the interpreter that has
# vLLM's CUDA build, $(PY) where it exists, else python3 (`make test-gpu PY=...` picks another).
# Both run, and it fails if either did.
GPU_PY = $(if $(or $(filter command line,$(origin PY)),$(wildcard $(PY))),$(PY),python3)
test-gpu:
	status=0; \
	$(GPU_PY) -m pytest -q -rs tests/gpu $(PYTEST_ARGS) || status=1; \
	PY=$(GPU_PY) bash scripts/gpu_smoke.sh --device cuda || status=1; \
	exit $$status

unit: setup
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

demo: setup
	@bash scripts/demo.sh

# The docs site (mkdocs.yml) is built strictly: a broken link, anchor or page fails. Its output
# goes to a temporary directory, never into the repository.
lint: setup
	$(VENV)/bin/ruff check atomr_infer tests scripts
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mkdocs build --strict --site-dir "$$(mktemp -d)"
