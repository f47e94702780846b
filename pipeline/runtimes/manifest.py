"""models/manifest.json: what the optimize stage shipped, read by the benchmark stage and the server.

pydantic + stdlib only (no torch, no onnxruntime), so the server image can read it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import StageError

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1

Format = Literal["torch-state-dict", "torch-export", "onnx"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Preprocess(_Strict):
    """How a request image becomes the model input (pipeline/preprocess.py implements it)."""

    roi_margin: float
    """Margin kept around a sign's ROI box when one is given (fraction of the box per side)."""
    resize: int
    """Square side the (cropped) image is resized to, bilinear."""
    mean: list[float]
    """Per-channel mean of the training split; applied INSIDE the model (do not normalise again)."""
    std: list[float]
    normalized_in_model: bool = True
    input_range: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    """The model takes RGB pixels / 255."""
    layout: Literal["NCHW"] = "NCHW"


class InputSpec(_Strict):
    name: str
    shape: list[int]
    """[-1, 3, S, S]: -1 is the dynamic batch dimension."""
    dtype: Literal["float32"] = "float32"


class Parity(_Strict):
    """An exported model against the torch model it came from, on the test images."""

    reference: str
    max_abs_diff: float
    top1_agreement: float
    passed: bool


class Variant(_Strict):
    name: str
    file: str
    """Path relative to the models folder (only set for shipped variants: accepted ones)."""
    format: Format
    runtimes: list[str]
    """Backends that can run it; the first one is the default (`auto`)."""
    precision: Literal["fp32", "bf16", "int8"]
    accuracy: float
    """Top-1 on the test split, as a fraction."""
    accuracy_drop: float
    """fp32 top-1 minus this variant's top-1 (fraction; negative = better)."""
    size_bytes: int
    sha256: str
    parameters: int
    accepted: bool
    reason: str = ""
    """Why it was rejected (empty when accepted)."""
    parity: Parity | None = None
    source: str = ""
    """The variant it was derived from."""
    details: dict[str, str | float | int | bool] = Field(default_factory=dict)


class ModelManifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    architecture: str
    classes: list[str]
    num_classes: int
    image_size: int
    preprocess: Preprocess
    input: InputSpec
    output: InputSpec
    baseline_accuracy: float
    """Top-1 of the fp32 torch model on the test split: what `accuracy_drop` is measured from."""
    test_images: int
    max_accuracy_drop: float
    variants: list[Variant]
    created_by: str = "pipeline optimize"

    def accepted(self) -> list[Variant]:
        return [v for v in self.variants if v.accepted]

    def variant(self, name: str) -> Variant:
        """The accepted variant called `name`, or a StageError listing the ones there are."""
        for v in self.variants:
            if v.name == name:
                if not v.accepted:
                    raise StageError(f"variant {name!r} was rejected by the optimize stage ({v.reason})")
                return v
        names = ", ".join(v.name for v in self.accepted()) or "none"
        raise StageError(f"unknown variant {name!r}; shipped variants: {names}")


def read_manifest(models_dir: Path) -> ModelManifest:
    """The typed manifest of `models_dir`; a StageError naming the file when missing or invalid."""
    path = Path(models_dir) / MANIFEST_NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise StageError(f"{path} not found: run `pipeline optimize` first") from None
    except (OSError, ValueError) as exc:
        raise StageError(f"{path} cannot be read ({exc})") from None
    try:
        return ModelManifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise StageError(f"{path}: invalid manifest ({where}: {first['msg']})") from None


def write_manifest(models_dir: Path, manifest: ModelManifest) -> Path:
    path = Path(models_dir) / MANIFEST_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
    tmp.replace(path)
    return path
