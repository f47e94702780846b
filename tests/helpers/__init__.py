"""Shared test helpers (imported by tests; fixtures stay in conftest.py files)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
