"""A real `pipeline serve` process on loopback, serving a model made by the real stages on tiny data."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.server import Server, start_server


@pytest.fixture
def server(models_dir: Path, tmp_path: Path) -> Iterator[Server]:
    running = start_server(models_dir, tmp_path, {})
    yield running
    running.stop()


@pytest.fixture(scope="session")
def models_dir(tiny_project: Path) -> Path:
    return tiny_project / "models"
