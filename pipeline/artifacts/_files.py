"""Reading and writing the artifacts' files: atomic replacement, and one StageError for missing or corrupt."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from pipeline.errors import StageError

M = TypeVar("M", bound=BaseModel)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write next to `path`, then rename over it: a reader (or a kill) never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (its directory entry on disk). Best effort: a filesystem that cannot
    open or sync a directory leaves it to the OS, as it does for every other write there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_model(path: Path, record: BaseModel) -> Path:
    return write_text_atomic(path, json.dumps(record.model_dump(mode="json"), indent=2) + "\n")


def read_json(path: Path, missing_hint: str) -> Any:
    """The parsed JSON of `path`; a StageError naming the file (and what to run) when missing or unreadable."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} not found: {missing_hint}") from None
    except (OSError, ValueError) as exc:
        raise StageError(f"{path} cannot be read ({type(exc).__name__}: {exc}); {missing_hint}") from None


def read_model(path: Path, schema: type[M], missing_hint: str, what: str = "") -> M:
    """`path` validated against `schema`; a StageError naming the file (`what` it should be) and the first wrong
    field."""
    raw = read_json(path, missing_hint)
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise StageError(
            f"{path}: invalid {what or schema.__name__} ({where}: {first['msg']}); {missing_hint}"
        ) from None
