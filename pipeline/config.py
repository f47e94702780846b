"""Typed, validated configuration: params.yaml -> pydantic models, checked once at the edge.

Every section is strict (no silent type coercion) and forbids unknown keys, so a typo in params.yaml
stops the run with a one-line message naming the key instead of being ignored.
This module imports nothing else from the package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# Paths come from YAML as strings; accept those (and only those) for Path fields.
PathField = Annotated[Path, Field(strict=False)]

# Where stages put their artifacts, relative to the project root (the working directory).
# dvc.yaml names the same paths; stages never hard-code them elsewhere.
PREPARED_DIR = Path("data/prepared")
MODELS_DIR = Path("models")
REPORTS_DIR = Path("reports")

GTSRB_ROOT_ENV = "GTSRB_ROOT"


class Section(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class DataConfig(Section):
    """The prepare stage: where GTSRB is, and how signs become arrays."""

    root: PathField = Path("data/raw")
    """Folder that holds (or receives) torchvision's `gtsrb/` layout. $GTSRB_ROOT overrides it."""
    download: bool = True
    """Let torchvision download GTSRB into `root` when it is not there (needs internet)."""
    image_size: int = Field(32, ge=8, le=256)
    """Side of the square images the model sees, in pixels."""
    roi_margin: float = Field(0.1, ge=0.0, le=1.0)
    """Margin kept around the official ROI box, as a fraction of the box size on each side."""
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)
    """Fraction of each class's tracks (physical signs) held out for validation."""
    max_bad_fraction: float = Field(0.01, ge=0.0, le=1.0)
    """Fail the stage when more than this fraction of images cannot be read."""
    seed: int = 42

    def resolved_root(self) -> Path:
        """`root`, unless $GTSRB_ROOT points the run at another copy."""
        env = os.environ.get(GTSRB_ROOT_ENV)
        return Path(env) if env else self.root


class ModelConfig(Section):
    name: Literal["trafficsignnet", "signnet"] = "signnet"


class TrainConfig(Section):
    epochs: int = Field(10, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(0.003, gt=0.0)
    weight_decay: float = Field(0.0005, ge=0.0)
    seed: int = 0


class EvaluateConfig(Section):
    min_accuracy: float = Field(0.0, ge=0.0, le=1.0)


class TrackingConfig(Section):
    """MLflow. $MLFLOW_TRACKING_URI, when set, wins over `uri`."""

    enabled: bool = True
    uri: str = "sqlite:///mlflow.db"
    experiment: str = "gtsrb"


class Params(Section):
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    tracking: TrackingConfig = TrackingConfig()


class ConfigError(Exception):
    """A user mistake in params.yaml: the message is meant to be shown as is, without a traceback."""


def _describe(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown key (check the spelling; see params.yaml for the valid keys)"
    given = error.get("input")
    return f"{where}: {error['msg'].lower()}, got {given!r}"


def parse_params(raw: Any, source: str = "params.yaml") -> Params:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        return Params.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{source}: {_describe(err)}" for err in exc.errors()]
        raise ConfigError("\n".join(lines)) from None


def load_params(path: Path = Path("params.yaml")) -> Params:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: not found (run from the project root or pass --params)") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}") from None
    return parse_params(raw, str(path))
