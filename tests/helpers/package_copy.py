"""A copy of the package with one new file and one new table line: how the extension tests add a toy entry."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.helpers import REPO


def package_with(where: Path, new_file: str, text: str, table: str, after: str, line: str) -> Path:
    """`where`/pipeline: the package, plus `new_file` (relative to it) holding `text`, and `line` inserted in
    `table` after the line starting with `after`. Returns `where`, for PYTHONPATH."""
    package = where / "pipeline"
    shutil.copytree(REPO / "pipeline", package)  # with its bytecode (make test compiles it): valid, same mtimes
    (package / new_file).write_text(text)
    lines = (package / table).read_text().splitlines(keepends=True)
    at = next(i for i, existing in enumerate(lines) if existing.startswith(after))
    (package / table).write_text("".join([*lines[: at + 1], line, *lines[at + 1 :]]))
    return where
