"""reports/evaluate/drift_reference.json: what the shipped variant sees and answers on the original test files, in
the drift signals' buckets (pipeline/monitoring/drift.py), written by evaluate; containerize puts it into the image, the server
shows it at /v1/drift-reference, and `pipeline monitor --drift` compares live traffic with it.

pydantic + stdlib only: the server image reads it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_model

REFERENCE_PATH = REPORTS_DIR / "evaluate" / "drift_reference.json"
RERUN = "run `pipeline evaluate` (or `dvc repro evaluate`)"


class SignalReference(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    edges: list[float]
    """Upper bounds of the buckets; `counts` has one more entry (above the last edge)."""
    counts: list[int]
    sum: float

    @model_validator(mode="after")
    def _sizes(self) -> SignalReference:
        if len(self.counts) != len(self.edges) + 1:
            raise ValueError(f"{len(self.edges)} edges need {len(self.edges) + 1} counts, not {len(self.counts)}")
        return self


class DriftReference(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str
    model_version: str
    """The first 12 hex digits of the variant file's SHA-256, as the server reports it."""
    source: str
    """What was counted, e.g. "645 original test files"."""
    classes: list[str]
    class_counts: list[int]
    signals: dict[str, SignalReference]

    @model_validator(mode="after")
    def _classes(self) -> DriftReference:
        if len(self.class_counts) != len(self.classes):
            raise ValueError(f"{len(self.classes)} classes but {len(self.class_counts)} class counts")
        return self


def write(reference: DriftReference, path: Path = REFERENCE_PATH) -> Path:
    return write_model(Path(path), reference)


def read(path: Path = REFERENCE_PATH) -> DriftReference:
    return read_model(Path(path), DriftReference, RERUN, "drift reference")


def read_for(variant: str, reports_dir: Path = REPORTS_DIR) -> DriftReference | None:
    """The reference when there is one and it was counted on `variant`; None otherwise."""
    path = Path(reports_dir) / REFERENCE_PATH.relative_to(REPORTS_DIR)
    if not path.is_file():
        return None
    reference = read(path)
    return reference if reference.variant == variant else None
