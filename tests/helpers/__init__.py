"""Shared test helpers (imported by tests; fixtures stay in conftest.py files)."""

from pathlib import Path

from pipeline.data.sources import DATA_SOURCES

REPO = Path(__file__).resolve().parents[2]

# Environment variables that point a data source at another copy of its data (DataSource.root_env): CI's sample.
DATA_ROOT_ENVS = sorted({source.root_env for source in DATA_SOURCES.values() if source.root_env})
