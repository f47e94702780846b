"""reports/evaluate/predictions.json: the shipped variant's class for every test image, in the prepared test split's
order, as evaluate measured it; deploy requires the image's answers through the API to be exactly these."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_model

PREDICTIONS_PATH = REPORTS_DIR / "evaluate" / "predictions.json"


class Predictions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str
    """The variant evaluate measured: the one the image ships."""
    model_version: str
    """The first 12 hex digits of its file's SHA-256, as the server reports it (a stale record is refused)."""
    classes: list[str]
    labels: list[int]
    """True class ids of the test images."""
    predicted: list[int]
    """Its top-1 class ids on the prepared (ROI-cropped) test images sent as FP32 tensors, one per test image."""
    served_predicted: list[int] = []
    """Its top-1 class ids on the test split's original files, whole, through the server's preprocessing
    (empty when the prepared data has no original files)."""

    @model_validator(mode="after")
    def _same_length(self) -> Predictions:
        if len(self.labels) != len(self.predicted):
            raise ValueError(f"{len(self.labels)} labels but {len(self.predicted)} predictions")
        if self.served_predicted and len(self.served_predicted) != len(self.labels):
            raise ValueError(f"{len(self.labels)} labels but {len(self.served_predicted)} served predictions")
        return self

    @property
    def accuracy(self) -> float:
        return sum(int(a == p) for a, p in zip(self.labels, self.predicted, strict=True)) / max(1, len(self.labels))

    @property
    def served_accuracy(self) -> float:
        """On the original files, whole, through the server's preprocessing (evaluate's headline)."""
        hits = sum(int(a == p) for a, p in zip(self.labels, self.served_predicted, strict=True))
        return hits / max(1, len(self.served_predicted))

    def first(self, count: int) -> Predictions:
        return Predictions(
            variant=self.variant,
            model_version=self.model_version,
            classes=self.classes,
            labels=self.labels[:count],
            predicted=self.predicted[:count],
            served_predicted=self.served_predicted[:count],
        )


def write(predictions: Predictions, path: Path = PREDICTIONS_PATH) -> Path:
    return write_model(path, predictions)


def read(path: Path = PREDICTIONS_PATH) -> Predictions:
    return read_model(path, Predictions, "run `pipeline evaluate` first")
