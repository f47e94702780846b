"""models/manifest.json + models/variants/: what the optimize stage shipped, read by the benchmark stage,
containerize and the server (through pipeline.runtimes).

pydantic + stdlib only (no torch, no onnxruntime), so the server image can read it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts._files import read_model, write_model
from pipeline.errors import StageError
from pipeline.images.preprocess import NO_CROP, Framing, Interpolation, Resize

MANIFEST_NAME = "manifest.json"
VARIANTS_FOLDER = "variants"  # models/variants/: the accepted variants' files
SCHEMA_VERSION = 1
# The trained model as a variant: the first optimize makes (pipeline/optimize/families), the gate's reference, the
# benchmark's baseline.
TRAINED = "fp32"

Format = Literal["torch-state-dict", "torch-export", "onnx"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Preprocess(_Strict):
    """How a request image becomes the model input (pipeline/images/preprocess.py implements it)."""

    roi_margin: float
    """Margin kept around a sign's ROI box when one is given (fraction of the box per side)."""
    resize: int
    """Square side the (cropped) image is resized to (with `interpolation`)."""
    mean: list[float]
    """Per-channel mean of the training split; applied INSIDE the model (do not normalise again)."""
    std: list[float]
    crop: tuple[float, float, float, float] = NO_CROP
    """Without a box: fractions of the width / height cut at the left, top, right and bottom of the whole image
    before the resize (prepare derives it from the training split's sign boxes)."""
    normalized_in_model: bool = True
    input_range: list[float] = Field(default_factory=lambda: [0.0, 1.0])
    """The model takes RGB pixels / 255."""
    layout: Literal["NCHW"] = "NCHW"
    resize_mode: Resize = "stretch"
    """How the (cropped) image becomes the square: stretch | center_crop | pad (data.resize; preprocess.to_array)."""
    interpolation: Interpolation = "bilinear"
    """The resize's filter: bilinear | bicubic (what the pretrained weights were made with; data.interpolation)."""

    reduced_jpeg_decode: bool = False
    """Large JPEGs decoded at 1/2, 1/4 or 1/8 of their size, never below `resize` (data.reduced_jpeg_decode)."""

    def framing(self) -> Framing:
        return Framing(
            self.resize, self.roi_margin, self.crop, self.resize_mode, self.interpolation, self.reduced_jpeg_decode
        )


class InputSpec(_Strict):
    name: str
    shape: list[int]
    """[-1, 3, S, S]: -1 is the dynamic batch dimension."""
    dtype: Literal["float32"] = "float32"


class Parity(_Strict):
    """An exported model against the torch model it came from, on the test images."""

    reference: str
    max_abs_diff: float
    max_rel_diff: float | None = None  # absent in manifests written before the scale-aware bound
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
    served_accuracy: float | None = None
    """Top-1 on the test split's original files, whole, through the server's decode + preprocess: what the API
    delivers (deploy's smoke test must reproduce it). None when the prepared data keeps no original files."""
    served_predicted: list[int] | None = None
    """Top-1 class of each of those files, in order: deploy's smoke test must get exactly these through the API."""
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
    """Top-1 of the fp32 torch model on the gate's images (the served test files plus validation framed as
    served, else the test split's ROI crops): what `accuracy_drop` is measured from."""
    test_images: int
    max_accuracy_drop: float
    variants: list[Variant]
    created_by: str = "pipeline optimize"
    initial_weights: dict[str, Any] | None = None
    """torchvision/timm networks: where training started from (backbones.WeightsInfo.record(): source, file,
    sha256, licence, the mean/std and interpolation they expect); None for our own networks."""

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


def read_manifest(models_dir: Path = MODELS_DIR) -> ModelManifest:
    """The typed manifest of `models_dir`; a StageError naming the file when missing or invalid."""
    return read_model(Path(models_dir) / MANIFEST_NAME, ModelManifest, "run `pipeline optimize` first", "manifest")


def write_manifest(models_dir: Path, manifest: ModelManifest) -> Path:
    return write_model(Path(models_dir) / MANIFEST_NAME, manifest)


def publish(staging: Path, manifest: ModelManifest, models_dir: Path = MODELS_DIR) -> ModelManifest:
    """Move the accepted variants' files from `staging` into models/variants/ and write the manifest naming
    them (paths relative to `models_dir`); returns that manifest. `staging` is removed.

    Kill-safe: the old manifest goes first, then the new folder is swapped in whole, and the new manifest is
    written (atomically) last. A kill at any point leaves either the old pair, the new pair, or no manifest
    (readers then say "run optimize"), never a manifest naming files it did not describe; and every file is
    checked against the manifest's SHA-256 when opened (pipeline.runtimes)."""
    models_dir = Path(models_dir)
    variants_dir = models_dir / VARIANTS_FOLDER
    fresh = models_dir / f".{VARIANTS_FOLDER}.new"
    retired = models_dir / f".{VARIANTS_FOLDER}.old"
    for leftover in (fresh, retired):
        shutil.rmtree(leftover, ignore_errors=True)
    fresh.mkdir(parents=True)
    shipped = []
    for v in manifest.variants:
        if v.accepted:
            (Path(staging) / v.file).replace(fresh / v.file)
            shipped.append(v.model_copy(update={"file": f"{VARIANTS_FOLDER}/{v.file}"}))
        else:
            shipped.append(v)
    (models_dir / MANIFEST_NAME).unlink(missing_ok=True)
    if variants_dir.exists():
        variants_dir.rename(retired)
    fresh.rename(variants_dir)
    published = manifest.model_copy(update={"variants": shipped})
    write_manifest(models_dir, published)
    shutil.rmtree(retired, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return published
