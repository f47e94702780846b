"""A folder built once per test session, whichever pytest-xdist worker asks first: the others wait for it and read
the same copy (session fixtures are per worker; a trained project made twice costs a worker a minute)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

BUILT = ".built"  # written last: a folder without it is a build that failed or was killed, and is made again


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """`build(folder)` fills an empty `folder` once; every caller gets the finished folder. Read it, or copy it
    before changing anything (`shutil.copytree(..., symlinks=True)`): the other worker may be reading it."""
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, shared by the workers (each has its own below it)
    folder = base / f"shared-{name}"
    with (base / f"shared-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while the first caller builds; released when the file closes
        if not (folder / BUILT).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            (folder / BUILT).touch()
    return folder
