"""The tests' data: small synthetic labelled images as users bring them, a folder of class folders (train/ and test/)
and a CSV over the same files that also gives each object's box and group (frames of one object)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = 43  # as many as a real multi-class set, so that per-class code sees many small classes


def picture(rng: np.random.Generator, label: int, width: int, height: int) -> Image.Image:
    """A noisy background with a class-coloured square 3 px inside each side: learnable, cheap to make."""
    pixels = rng.integers(0, 60, size=(height, width, 3), dtype=np.uint8)
    colour = np.array([(label * 37) % 256, (label * 91) % 256, (label * 53) % 256], dtype=np.uint8)
    pixels[3 : height - 3, 3 : width - 3] = colour
    return Image.fromarray(pixels)


@dataclass(frozen=True)
class SyntheticImages:
    folder: Path
    """data.source: folder: FOLDER/train/<class>/<group>_<frame>.png and FOLDER/test/<class>/<n>.png."""
    csv: Path
    """data.source: csv: the same files with path,label,group,box,split (box: the coloured square)."""


def write_synthetic_images(
    root: Path, groups_per_class: int = 3, frames_per_group: int = 2, test_per_class: int = 2, seed: int = 0
) -> SyntheticImages:
    """CLASSES classes of 20-39 px images under root/signs (the folder's name names the run: `signs`)."""
    rng = np.random.default_rng(seed)
    folder = root / "signs"
    rows = ["path,label,group,box,split"]
    for label in range(CLASSES):
        name = f"{label:02d}"
        for split, count in (("train", groups_per_class * frames_per_group), ("test", test_per_class)):
            (folder / split / name).mkdir(parents=True)
            for n in range(count):
                w, h = int(rng.integers(20, 40)), int(rng.integers(20, 40))
                group, frame = divmod(n, frames_per_group)
                file = f"{group:02d}_{frame:02d}.png" if split == "train" else f"{n:02d}.png"
                picture(rng, label, w, h).save(folder / split / name / file)
                group_name = f"{name}-{group}" if split == "train" else ""
                rows.append(f"{split}/{name}/{file},{name},{group_name},3 3 {w - 4} {h - 4},{split}")
    csv = folder / "signs.csv"
    csv.write_text("\n".join(rows) + "\n")
    return SyntheticImages(folder, csv)
