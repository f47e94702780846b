# Two commands on a fresh machine (Python >= 3.11 and git are all it needs):
#   make pipeline   # create the environment if needed, then run the DVC pipeline (dvc repro)
#   make test       # create the environment if needed, then lint, type-check and run every test (as CI does)
SHELL := /bin/bash
.DEFAULT_GOAL := help

# uv from PATH, else a private copy installed once into .tools/ (pip from PyPI, nothing else needed).
UV := $(shell command -v uv 2>/dev/null || echo .tools/bin/uv)
STAGE ?=
PYTEST_ARGS ?=

.PHONY: help env pipeline test test-fast lint mlflow-ui clean

help:
	@echo "make pipeline   run the DVC pipeline (set GTSRB_ROOT to use an existing GTSRB copy)"
	@echo "make test       lint, type-check and run all tests, as CI does"
	@echo "make test-fast  the fast tests only (no 'slow' marker)"
	@echo "make mlflow-ui  browse the tracked runs at http://127.0.0.1:5000"

.tools/bin/uv:
	python3 -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv

.venv/.synced: $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen
	@touch $@

env: .venv/.synced

pipeline: env
	$(UV) run --frozen dvc repro $(STAGE)

lint: env
	$(UV) run --frozen ruff check pipeline tests
	$(UV) run --frozen ruff format --check pipeline tests
	$(UV) run --frozen mypy

test: lint
	$(UV) run --frozen pytest $(PYTEST_ARGS)

test-fast: env
	$(UV) run --frozen pytest -m "not slow" $(PYTEST_ARGS)

mlflow-ui: env
	$(UV) run --frozen mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf .tools .venv .mypy_cache .ruff_cache .pytest_cache
