"""reports/containerize/image.json: the server image containerize built (or why it built none), read by deploy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_model

IMAGE_PATH = REPORTS_DIR / "containerize" / "image.json"


class ImageRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    skipped: bool
    reason: str = ""
    """Why no image was built (skipped only)."""
    image: str = ""
    """Repository, e.g. gtsrb-server or ghcr.io/OWNER/gtsrb-server."""
    tag: str = ""
    """The native platform's first tag: repository:commit."""
    id: str = ""
    """Image id (sha256:...) on the engine that built it."""
    size_bytes: int = 0
    size_mb: float = 0.0
    build_seconds: float = 0.0
    variant: str = ""
    model_version: str = ""
    """First 12 hex digits of the variant file's SHA-256 (what the server reports as its version)."""
    model_accuracy: float | None = None
    """The variant's test accuracy as the optimize stage recorded it."""
    revision: str = ""
    dirty: bool = False
    source: str = ""
    engine: str = ""
    builds: list[dict[str, Any]] = Field(default_factory=list)
    """One entry per platform: platform, id, tags, size, build time, base image, context digest."""


def write(record: ImageRecord, path: Path = IMAGE_PATH) -> Path:
    return write_model(path, record)


def read(path: Path = IMAGE_PATH) -> ImageRecord:
    return read_model(path, ImageRecord, "run `pipeline containerize` first")
