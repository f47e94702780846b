"""data/prepared/'s schema: where its files are, the manifest's records, and the arrays one split holds in memory."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import DATA_DIR
from pipeline.images.preprocess import NO_CROP, Framing, Interpolation, Resize

PREPARED_DIR = DATA_DIR / "prepared"
MANIFEST_FILE = "manifest.json"
TEST_FILES = "test_files"
SPLITS = ("train", "val", "test")
LABELS_FILE = "labels.npy"
TRACKS_FILE = "tracks.npy"
RERUN = "run `pipeline prepare` first (or `dvc pull`)"
SHARD_MB = 64


@dataclass
class SplitArrays:
    images: np.ndarray  # uint8 [N, S, S, 3]
    labels: np.ndarray  # uint8 [N]
    tracks: np.ndarray  # int32 [N]: class * 100_000 + track, -1 for test

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def model_input(self) -> np.ndarray:
        """float32 [N, 3, S, S] in [0, 1]: what every runtime's predict() takes."""
        return to_model_input(self.images)


def to_model_input(images: np.ndarray) -> np.ndarray:
    """uint8 [N, S, S, 3] -> float32 [N, 3, S, S] in [0, 1] (the server's own conversion, value for value)."""
    return np.ascontiguousarray(images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardInfo(_Record):
    file: str
    """Path under data/prepared/ (SPLIT/images-NNNNN.npy)."""
    count: int
    sha256: str
    """Of the shard's pixel bytes (not the .npy header)."""


class DataSubject(_Record):
    """What a data set's images show, in the model card's words: a built-in source says; a folder of yours is
    described by its classes."""

    one: str
    """What one image shows (the card: "Classify a photo of one ...")."""
    groups: str = "groups"
    """What the groups split off whole for validation are called."""
    group_is: str = "objects"
    """What one group is."""
    untested: str | None = None
    """Conditions the data does not cover, for the card's limits."""


class SplitInfo(_Record):
    file: str
    """The split's folder under data/prepared/."""
    count: int
    per_class: list[int]
    tracks: int | None
    """Groups (photos of one object, kept together) in the split; None for the test split."""
    shards: list[ShardInfo] = []


class BadImages(_Record):
    count: int
    of: int
    files: list[str]


class PreparedManifest(_Record):
    dataset: str
    layout: str
    image_size: int
    roi_margin: float
    num_classes: int
    classes: list[str]
    mean: list[float]
    """Per-channel mean of the training split's pixels / 255 (used by `model.input_norm: dataset`)."""
    std: list[float]
    splits: dict[str, SplitInfo]
    bad_images: BadImages
    content_sha256: str
    """SHA-256 of every split's images and labels: what a checkpoint or a model was made from."""
    test_files: list[str] = []
    """The test split's original files under data/prepared/ (test_files/NAME), one per test image, in order."""
    image_size_reason: str = ""
    """Why `image_size` differs from data.image_size, when the time budget chose it (data.min_image_size); empty
    when it is data.image_size as written."""
    boxes: bool = True
    """Whether the test files carry object boxes. Without them the test arrays (the ROI protocol) are the served
    input itself, so evaluate and optimize score them once."""
    framing: Literal["served", "roi"] = "roi"
    """How train and val were made: `served` = whole files less `crop` (what the server is sent), `roi` = the
    sign's box + roi_margin. The test arrays are always the ROI protocol (how papers report the demo data); the served
    test input is test_files/ through `served_framing()`."""
    crop: tuple[float, float, float, float] = NO_CROP
    """What the served input cuts off a whole image (left, top, right, bottom fractions); see preprocess.Framing."""
    resize_mode: Resize = "stretch"
    """How the image becomes a square (data.resize): stretch | center_crop | pad."""
    interpolation: Interpolation = "bilinear"
    """The resize's filter (data.interpolation, `auto` resolved from model.name's pretrained weights)."""
    reduced_jpeg_decode: bool = False
    """Large JPEGs decoded at a fraction of their size (data.reduced_jpeg_decode)."""
    subject: DataSubject | None = None
    """What the images show, when the source says (the model card's intended use and limits)."""

    def served_framing(self) -> Framing:
        """How the server turns a file into this data's model input (optimize copies it into models/manifest)."""
        return Framing(
            self.image_size, self.roi_margin, self.crop, self.resize_mode, self.interpolation, self.reduced_jpeg_decode
        )


def content_sha256(arrays: dict[str, SplitArrays]) -> str:
    """The hash the writer computes as it streams: each split's image bytes, then its labels, in SPLITS order."""
    digest = hashlib.sha256()
    for split in SPLITS:
        for array in (arrays[split].images, arrays[split].labels):
            digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()
