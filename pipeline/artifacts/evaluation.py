"""reports/evaluate/metrics.json: evaluate's figures on the test split (DVC metrics), read by the model card.

They are the shipped variant's (`variant`, `model_version`): the headline `accuracy` on what users send (the original
files, whole, through the server's preprocessing), `roi_accuracy` the ROI protocol beside it; the trained model's
on the same inputs as `trained_*`. Extra keys are kept (DVC shows them all)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_text_atomic

METRICS_PATH = REPORTS_DIR / "evaluate" / "metrics.json"


class ClassFigures(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    class_id: int
    accuracy: float
    support: int
    f1: float


class WorstClass(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    class_id: int
    name: str
    accuracy: float
    support: int
    most_confused_with: str | None


class EvaluationMetrics(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    variant: str
    model_version: str
    accuracy: float
    measured_on: str
    roi_accuracy: float
    roi_errors: int
    whole_vs_roi_gap_points: float | None = None
    macro_f1: float
    errors: int
    images: int
    per_class: dict[str, ClassFigures]
    """By class name: accuracy (recall), support and F1, on the headline's input."""
    worst_classes: list[WorstClass]
    trained_accuracy: float
    """The trained model (before optimisation) on the headline's input."""
    trained_roi_accuracy: float
    trained_errors: int


def write(metrics: dict[str, Any], path: Path = METRICS_PATH) -> Path:
    EvaluationMetrics.model_validate(metrics)  # the reader's contract holds for what is written
    return write_text_atomic(path, json.dumps(metrics, indent=2) + "\n")


def read(path: Path = METRICS_PATH) -> EvaluationMetrics:
    return read_model(path, EvaluationMetrics, "run `pipeline evaluate` first", "evaluation metrics")
