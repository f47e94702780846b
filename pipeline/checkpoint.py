"""Training checkpoints: torch.distributed.checkpoint (DCP) folders, written atomically and verified.

Layout: `models/checkpoints/step_00000123/` holds DCP's files (`.metadata`, `__0_0.distcp`, ...), the
trainer's state (`trainer.json`: step, loader position, history) and, written last, `COMPLETE.json`
with the size and SHA-256 of every other file. A folder is written as `step_....partial` and renamed
only once complete, so a run killed while saving leaves a `.partial` folder that is ignored (and removed
by the next save). A complete folder whose files no longer match `COMPLETE.json` is corrupt: resuming
stops with its name instead of using it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import StageError

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer.json"
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d{8})$")


def folder_name(step: int) -> str:
    return f"step_{step:08d}"


def sha256_of(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _fsync_dir(path: Path) -> None:
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


def seal(partial: Path, trainer_state: dict[str, Any]) -> Path:
    """Write the trainer state and the marker into a fully written `.partial` folder, then rename it.
    Called by one process after every process has finished writing its DCP shards."""
    (partial / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(partial.rglob("*")):
        if path.is_file() and path.name != MARKER:
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
            files[str(path.relative_to(partial))] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    marker = partial / MARKER
    marker.write_text(json.dumps({"files": files}, indent=1))
    with marker.open("rb") as fh:
        os.fsync(fh.fileno())
    final = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    _fsync_dir(final.parent)
    return final


def complete_folders(root: Path) -> list[Path]:
    """Complete-looking checkpoint folders (named step_NNNNNNNN), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name)


def partial_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX))


def verify(folder: Path) -> dict[str, Any]:
    """Check every file against the marker; return the trainer state. StageError names what is wrong."""
    marker = folder / MARKER
    hint = f"delete {folder} to resume from an older checkpoint, or models/checkpoints to start over"
    if not marker.exists():
        raise StageError(f"checkpoint {folder} is incomplete: {MARKER} is missing ({hint})")
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError, TypeError):
        raise StageError(f"checkpoint {folder} is corrupt: {MARKER} cannot be read ({hint})") from None
    for name, info in files.items():
        path = folder / name
        if not path.is_file():
            raise StageError(f"checkpoint {folder} is corrupt: {name} is missing ({hint})")
        size = path.stat().st_size
        if size != info["size"]:
            raise StageError(
                f"checkpoint {folder} is corrupt: {name} has {size} bytes, expected {info['size']} "
                f"(truncated?) ({hint})"
            )
        if sha256_of(path) != info["sha256"]:
            raise StageError(f"checkpoint {folder} is corrupt: {name} fails its SHA-256 check ({hint})")
    if TRAINER_STATE not in files:
        raise StageError(f"checkpoint {folder} is corrupt: {TRAINER_STATE} is missing ({hint})")
    try:
        state: dict[str, Any] = json.loads((folder / TRAINER_STATE).read_text())
    except ValueError:
        raise StageError(f"checkpoint {folder} is corrupt: {TRAINER_STATE} is not JSON ({hint})") from None
    return state


@dataclass(frozen=True)
class Resume:
    folder: Path
    state: dict[str, Any]


def latest(root: Path) -> Resume | None:
    """The newest complete checkpoint, verified; None when there is none. Never falls back silently:
    a corrupt newest checkpoint raises StageError naming it."""
    folders = complete_folders(root)
    if not folders:
        return None
    folder = folders[-1]
    return Resume(folder, verify(folder))


def prune(root: Path, keep: int) -> None:
    """Remove leftover `.partial` folders and all but the `keep` newest complete checkpoints."""
    for path in partial_folders(root):
        shutil.rmtree(path, ignore_errors=True)
    for path in complete_folders(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
