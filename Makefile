# Two commands on a fresh machine (Python >= 3.11 and git are all it needs):
#   make pipeline   # create the environment if needed, then run the DVC pipeline (dvc repro)
#   make test       # create the environment if needed, then lint, type-check and run every test (as CI does)
#   make docs       # the documentation site (docs/, mkdocs.yml) into site/, as CI and the Pages workflow build it
SHELL := /bin/bash
.DEFAULT_GOAL := help

# uv from PATH, else a private copy installed once into .tools/ (pip from PyPI, nothing else needed).
UV := $(shell command -v uv 2>/dev/null || echo .tools/bin/uv)
STAGE ?=
# Ports that do not collide: the server 8000 (serve.port), a local registry 5000 (deploy.registry), the MLflow UI:
MLFLOW_UI_PORT ?= 5050
PYTEST_ARGS ?= --durations=30
# The team tracking stack's data, logs and generated credentials (git-ignored).
PLATFORM_DIR ?= .platform

# The light commands (pipeline compare, pipeline monitor) need no torch: a small environment, versions from uv.lock.
LIGHT_PACKAGES := numpy scipy pillow pydantic pyyaml typer rich prometheus-client packaging
# `make act WORKFLOW=pipeline` runs a workflow's jobs here with act (scripts/act.sh; ACT_ARGS for more flags).
WORKFLOW ?= ci
ACT_ARGS ?=
# `make docs` builds the site (mkdocs.yml, docs/) into site/ in its own small environment: the docs group of
# uv.lock only, no torch (mkdocstrings reads the package's source without importing it).
DOCS_VENV ?= .venv-docs

.PHONY: help env env-light pipeline test test-fast bytecode docs lint mlflow-ui platform-up platform-down platform-image act changelog clean

help:
	@echo "make pipeline   run the DVC pipeline (set GTSRB_ROOT to use an existing GTSRB copy)"
	@echo "make test       lint, type-check and run all tests, as CI does"
	@echo "make test-fast  the fast tests only (no 'slow' marker)"
	@echo "make docs       build the documentation site into site/ (mkdocs build --strict)"
	@echo "make mlflow-ui  browse the tracked runs at http://127.0.0.1:$(MLFLOW_UI_PORT) (MLFLOW_UI_PORT=...)"
	@echo "make platform-up    the team tracking stack here: PostgreSQL + SeaweedFS S3 + MLflow server (PLATFORM_DIR)"
	@echo "make platform-down  stop it (data kept in PLATFORM_DIR)"
	@echo "make platform-image the same stack's image for deploy/platform/compose.yaml (credentials in PLATFORM_DIR)"
	@echo "make act        run a GitHub workflow locally with act (WORKFLOW=ci|pipeline, ACT_ARGS=...)"
	@echo "make changelog VERSION=X.Y.Z  CHANGELOG.md's section for the commits since the last tag, the version in pyproject.toml"

.tools/bin/uv:
	python3 -m venv .tools
	.tools/bin/pip install --quiet --disable-pip-version-check uv

# Where Python may not write bytecode (PYTHONDONTWRITEBYTECODE), every process would compile torch's sources again
# on import (seconds each): compile them once here instead.
.venv/.synced: $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen $(if $(PYTHONDONTWRITEBYTECODE),--compile-bytecode)
	@touch $@

env: .venv/.synced

# Where Python may not write bytecode, this project's own modules too (no environment holds them): the suite starts
# hundreds of processes.
bytecode: env
	$(if $(PYTHONDONTWRITEBYTECODE),$(UV) run --frozen python -m compileall -q pipeline benchmarks tests)

.venv-light/.synced: $(UV) uv.lock Makefile
	$(UV) venv --quiet --allow-existing .venv-light
	$(UV) export --frozen --no-hashes --no-emit-project --no-header --quiet -o .venv-light/constraints.txt
	$(UV) pip install --quiet --python .venv-light -c .venv-light/constraints.txt $(LIGHT_PACKAGES)
	@touch $@

# Run the light commands as `PYTHONPATH=. .venv-light/bin/python -m pipeline.cli monitor|compare ...`
env-light: .venv-light/.synced

# A release: `make changelog VERSION=0.3.0`, commit ("release: v0.3.0"), push to the default branch: tag.yml tags
# that commit v0.3.0 (scripts/release-tag.sh; `copier update --vcs-ref v0.3.0` moves projects to it).
changelog:
	@echo "$(VERSION)" | grep -Eq '^[0-9]+\.[0-9]+\.[0-9]+$$' || { echo "usage: make changelog VERSION=X.Y.Z" >&2; exit 2; }
	$(MAKE) env
	GIT_CLIFF=.venv/bin/git-cliff scripts/changelog.sh $(VERSION)
	$(UV) lock --quiet

pipeline: env
	scripts/raw-data.sh
	$(UV) run --frozen dvc repro $(STAGE)

# The type checker `make lint` runs; MYPY=: skips it (the ci.yml job under act: this checkout's own `make test` has
# type-checked the same files, and mypy's cache does not carry over to the job's copy).
MYPY ?= $(UV) run --frozen mypy
lint: env
	$(UV) run --frozen ruff check pipeline benchmarks tests
	$(UV) run --frozen ruff format --check pipeline benchmarks tests
	$(MYPY)

platform-up: env
	$(UV) run --frozen pipeline platform up --dir $(PLATFORM_DIR)

platform-down: env
	$(UV) run --frozen pipeline platform down --dir $(PLATFORM_DIR)

platform-image: env
	$(UV) run --frozen pipeline platform image --dir $(PLATFORM_DIR)

# Three workers (pytest-xdist) on two cores: the slow tests wait on subprocesses, servers and builds, and a third
# worker keeps both cores busy; tests/conftest.py keeps each file on one worker and the Docker engine's tests
# together. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 3
test: lint bytecode
	$(UV) run --frozen pytest -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: env bytecode
	$(UV) run --frozen pytest -m "not slow" $(PYTEST_ARGS)

docs: $(UV)
	NO_MKDOCS_2_WARNING=1 UV_PROJECT_ENVIRONMENT=$(DOCS_VENV) $(UV) run --frozen --only-group docs mkdocs build --strict

mlflow-ui: env
	@$(UV) run --frozen python -m pipeline.machine.ports 127.0.0.1 $(MLFLOW_UI_PORT) MLFLOW_UI_PORT
	$(UV) run --frozen mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port $(MLFLOW_UI_PORT)

act: env
	scripts/act.sh $(WORKFLOW) $(ACT_ARGS)

clean:
	rm -rf .tools .venv .venv-light .venv-docs site .act-artifacts .mypy_cache .ruff_cache .pytest_cache
