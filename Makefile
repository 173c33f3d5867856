# The two commands a new user needs: `make demo` and `make test`. Both set up first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test unit demo lint clean-ray
setup:
	@bash scripts/setup.sh

# tests/multinode joins a cluster of its own, so it runs in a pytest session of its own.
test: setup
	$(PY) -m pytest -q -rs --durations=10 $(PYTEST_ARGS)
	$(PY) -m pytest -q -rs tests/multinode $(PYTEST_ARGS)

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
