"""data/prepared/: the prepare stage's output, read by train, evaluate, optimize, benchmark, deploy and monitor.

    data/prepared/{train,val,test}.npz   images uint8 [N, S, S, 3] RGB, labels uint8 [N], tracks int32 [N]
    data/prepared/manifest.json          PreparedManifest: image size, classes, mean/std, per-split counts, hash
    data/prepared/test_files/            the test split's original image files, byte for byte, in the arrays'
                                         order: what a user sends the server (whole images, no box)

The folder is written to a staging folder and swapped in whole, so readers never see half of it. numpy and
pydantic only: the server image and `pipeline monitor` read it without torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import DATA_DIR
from pipeline.artifacts._files import read_model, write_model
from pipeline.errors import StageError
from pipeline.preprocess import NO_CROP, Framing, Resize

PREPARED_DIR = DATA_DIR / "prepared"
MANIFEST_FILE = "manifest.json"
TEST_FILES = "test_files"
SPLITS = ("train", "val", "test")
RERUN = "run `pipeline prepare` first (or `dvc pull`)"


@dataclass
class SplitArrays:
    images: np.ndarray  # uint8 [N, S, S, 3]
    labels: np.ndarray  # uint8 [N]
    tracks: np.ndarray  # int32 [N]: class * 100_000 + track, -1 for test

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def model_input(self) -> np.ndarray:
        """float32 [N, 3, S, S] in [0, 1]: what every runtime's predict() takes."""
        return np.ascontiguousarray(self.images.transpose(0, 3, 1, 2), dtype=np.float32) / np.float32(255)


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SplitInfo(_Record):
    file: str
    count: int
    per_class: list[int]
    tracks: int | None
    """Physical signs (GTSRB tracks) in the split; None for the test split."""


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
    framing: Literal["served", "roi"] = "roi"
    """How train and val were made: `served` = whole files less `crop` (what the server is sent), `roi` = the
    sign's box + roi_margin. test.npz is always the ROI protocol (how papers report GTSRB); the served test
    input is test_files/ through `served_framing()`."""
    crop: tuple[float, float, float, float] = NO_CROP
    """What the served input cuts off a whole image (left, top, right, bottom fractions); see preprocess.Framing."""
    resize_mode: Resize = "stretch"
    """How the image becomes a square (data.resize): stretch | center_crop | pad."""

    def served_framing(self) -> Framing:
        """How the server turns a file into this data's model input (optimize copies it into models/manifest)."""
        return Framing(self.image_size, self.roi_margin, self.crop, self.resize_mode)


def content_sha256(arrays: dict[str, SplitArrays]) -> str:
    digest = hashlib.sha256()
    for split in SPLITS:
        for array in (arrays[split].images, arrays[split].labels):
            digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def write(
    arrays: dict[str, SplitArrays],
    manifest: PreparedManifest,
    out_dir: Path = PREPARED_DIR,
    test_originals: list[Path] | None = None,
) -> Path:
    """Write the three splits, the test split's original files (copied byte for byte, named as in the manifest's
    `test_files`) and the manifest into a staging folder, then swap it in for `out_dir`."""
    originals = test_originals or []
    if len(originals) != len(manifest.test_files) or (originals and len(originals) != len(arrays["test"])):
        raise ValueError("one original file per test image, named in the manifest's test_files")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.parent.glob(f".{out_dir.name}-*"):  # left by a killed run (DVC runs one at a time)
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the outputs are ordinary files
    try:
        for split in SPLITS:
            a = arrays[split]
            np.savez(staging / f"{split}.npz", images=a.images, labels=a.labels, tracks=a.tracks)
        if originals:
            (staging / TEST_FILES).mkdir()
        for source, name in zip(originals, manifest.test_files, strict=True):
            shutil.copyfile(source, staging / name)
        write_model(staging / MANIFEST_FILE, manifest)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(new: Path, target: Path) -> None:
    """Swap `new` into `target` so readers never see a half-written folder. A kill between the two renames
    leaves `target.old` and no `target`: the next call (or a reader's error) starts from there, nothing mixes."""
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        target.rename(old)
    new.rename(target)
    _fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(prepared: Path = PREPARED_DIR) -> PreparedManifest:
    return read_model(Path(prepared) / MANIFEST_FILE, PreparedManifest, RERUN)


def read_split(
    split: str,
    prepared: Path = PREPARED_DIR,
    *,
    image_size: int | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> SplitArrays:
    """One split's arrays, checked (uint8 [N, S, S, 3], N labels; S = `image_size` when given). With `limit`,
    a seeded random subset of that many images (in their original order)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}")
    path = Path(prepared) / f"{split}.npz"
    if not path.is_file():
        raise StageError(f"{path} not found: {RERUN}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            images = np.ascontiguousarray(npz["images"])
            labels = np.asarray(npz["labels"])
            tracks = np.asarray(npz["tracks"]) if "tracks" in npz.files else np.full(len(labels), -1, np.int32)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:  # truncated: BadZipFile
        raise StageError(f"{path} cannot be read ({type(exc).__name__}: {exc}); rerun `pipeline prepare`") from None
    side = f"{image_size}" if image_size else "S"
    if (
        images.dtype != np.uint8
        or images.ndim != 4
        or images.shape[3] != 3
        or (image_size is not None and images.shape[1:3] != (image_size, image_size))
    ):
        raise StageError(
            f"{path}: images are {images.dtype} {list(images.shape)}, expected uint8 [N, {side}, {side}, 3] "
            "(rerun `pipeline prepare` with the model's data.image_size)"
        )
    if len(labels) != len(images):
        raise StageError(f"{path}: {len(images)} images but {len(labels)} labels; rerun `pipeline prepare`")
    arrays = SplitArrays(images, labels, tracks)
    if limit is not None and limit < len(arrays):
        pick = np.sort(np.random.default_rng(seed).choice(len(arrays), size=limit, replace=False))
        arrays = SplitArrays(images[pick], labels[pick], tracks[pick])
    return arrays


@dataclass(frozen=True)
class OriginalFile:
    """A test image as a user sends it: the encoded file, whole (no ROI box), and its label."""

    path: Path
    label: int

    def read_bytes(self) -> bytes:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            raise StageError(f"{self.path} cannot be read ({exc}); rerun `pipeline prepare`") from None


def read_test_files(prepared: Path = PREPARED_DIR) -> list[OriginalFile]:
    """The test split's original files with their labels, in the test arrays' order; empty when the prepared
    data has none (made by an older prepare, or by a test's fake)."""
    manifest = read_manifest(prepared)
    if not manifest.test_files:
        return []
    labels = read_split("test", prepared).labels
    if len(labels) != len(manifest.test_files):
        raise StageError(
            f"{Path(prepared) / MANIFEST_FILE}: {len(manifest.test_files)} test files for {len(labels)} test images; rerun `pipeline prepare`"
        )
    return [
        OriginalFile(Path(prepared) / name, int(label)) for name, label in zip(manifest.test_files, labels, strict=True)
    ]
