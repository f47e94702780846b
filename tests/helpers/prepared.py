"""Fake prepared data, written through the prepare stage's own writer (artifacts.prepared): the same files,
manifest and checks as the real stage, with pixels a tiny network learns in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.artifacts import prepared
from pipeline.artifacts.prepared import SPLITS, BadImages, PreparedManifest, SplitArrays

CLASSES = [f"class {i}" for i in range(43)]


def _colours(labels: np.ndarray) -> np.ndarray:
    ids = labels.astype(np.int64)
    return np.stack([(ids * 37) % 256, (ids * 91) % 256, (ids * 53) % 256], axis=1)


def noisy_colours(rng: np.random.Generator, count: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every class in turn: its colour over the whole image plus Gaussian noise."""
    labels = (np.arange(count) % 43).astype(np.uint8)
    noise = rng.normal(0.0, 25.0, size=(count, size, size, 3))
    images = np.clip(_colours(labels).astype(np.float32)[:, None, None, :] + noise, 0, 255).astype(np.uint8)
    return images, labels


def coloured_squares(rng: np.random.Generator, count: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Random classes: a dark noisy background with a class-coloured square."""
    labels = rng.integers(0, 43, count)
    images = rng.integers(0, 60, (count, size, size, 3)).astype(np.uint8)
    colours = _colours(labels)
    for i in range(count):
        images[i, 2:-2, 2:-2] = colours[i]
    return images, labels.astype(np.uint8)


def write_prepared(
    root: Path,
    sizes: tuple[int, int, int] = (256, 86, 86),
    image_size: int = 16,
    seed: int = 0,
    pixels: str = "noisy_colours",
    mean: tuple[float, float, float] = (0.45, 0.4, 0.35),
    std: tuple[float, float, float] = (0.25, 0.25, 0.25),
    originals: bool = False,
    shard_mb: float = prepared.SHARD_MB,
) -> Path:
    """data/prepared/ under `root` with `sizes` train/val/test images of all 43 classes; with `originals`, the
    test split's "original files" too: PNGs at twice the size with a dark frame, as a camera would send them."""
    rng = np.random.default_rng(seed)
    make = noisy_colours if pixels == "noisy_colours" else coloured_squares
    arrays: dict[str, SplitArrays] = {}
    for split, count in zip(SPLITS, sizes, strict=True):
        images, labels = make(rng, count, image_size)
        arrays[split] = SplitArrays(images, labels, np.full(count, -1, dtype=np.int32))
    manifest = PreparedManifest(
        dataset="synthetic",
        layout="images: uint8 [N, H, W, 3] RGB; labels: uint8 [N]",
        image_size=image_size,
        roi_margin=0.1,
        num_classes=len(CLASSES),
        classes=CLASSES,
        mean=list(mean),
        std=list(std),
        splits={},  # the writer lists each split's shards and counts
        bad_images=BadImages(count=0, of=sum(sizes), files=[]),
        content_sha256="",  # and the hash of what it wrote
    )
    files: list[Path] = []
    if originals:
        source = root / "originals"
        source.mkdir(parents=True, exist_ok=True)
        for i, pixels in enumerate(arrays["test"].images):
            big = Image.fromarray(pixels).resize((2 * image_size, 2 * image_size), Image.Resampling.NEAREST)
            framed = Image.new("RGB", (2 * image_size + 8, 2 * image_size + 8), (20, 20, 20))
            framed.paste(big, (4, 4))
            files.append(source / f"{i:05d}.png")
            framed.save(files[-1])
        manifest = manifest.model_copy(update={"test_files": [f"{prepared.TEST_FILES}/{p.name}" for p in files]})
    return prepared.write(arrays, manifest, root / prepared.PREPARED_DIR, files, shard_mb)


def replace_split(folder: Path, split: str, images: np.ndarray, labels: np.ndarray) -> Path:
    """data/prepared/ with one split's rows replaced (the others, the manifest's fields and the test originals
    kept), written through the same writer."""
    arrays = {s: prepared.read_split(s, folder) for s in SPLITS}
    arrays[split] = SplitArrays(images, labels, np.full(len(labels), -1, dtype=np.int32))
    manifest = prepared.read_manifest(folder)
    originals = [folder / name for name in manifest.test_files]
    if originals:  # the writer swaps the folder: the originals move to a scratch copy first
        scratch = folder.parent / "originals-kept"
        scratch.mkdir(exist_ok=True)
        originals = [Path(shutil.copy(path, scratch / path.name)) for path in originals]
    return prepared.write(arrays, manifest, folder, originals)
