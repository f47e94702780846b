"""A tiny synthetic GTSRB in torchvision's layout (train folders + CSVs, test images + CSV)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

HEADER = "Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"


def _sign(rng: np.random.Generator, label: int, width: int, height: int) -> Image.Image:
    """A noisy background with a class-coloured square where the ROI is: learnable, cheap to make."""
    pixels = rng.integers(0, 60, size=(height, width, 3), dtype=np.uint8)
    colour = np.array([(label * 37) % 256, (label * 91) % 256, (label * 53) % 256], dtype=np.uint8)
    pixels[3 : height - 3, 3 : width - 3] = colour
    return Image.fromarray(pixels)


def write_synthetic_gtsrb(
    root: Path, tracks_per_class: int = 3, frames_per_track: int = 2, test_per_class: int = 2, seed: int = 0
) -> Path:
    """Write all 43 classes in torchvision's GTSRB layout (train folders + CSVs, test images + CSV)."""
    rng = np.random.default_rng(seed)
    base = root / "gtsrb" / "GTSRB"
    for label in range(43):
        folder = base / "Training" / f"{label:05d}"
        folder.mkdir(parents=True)
        rows = [HEADER]
        for track in range(tracks_per_class):
            for frame in range(frames_per_track):
                w, h = int(rng.integers(20, 40)), int(rng.integers(20, 40))
                name = f"{track:05d}_{frame:05d}.ppm"
                _sign(rng, label, w, h).save(folder / name)
                rows.append(f"{name};{w};{h};3;3;{w - 4};{h - 4};{label}")
        (folder / f"GT-{label:05d}.csv").write_text("\r\n".join(rows) + "\r\n")
    images = base / "Final_Test" / "Images"
    images.mkdir(parents=True)
    rows = [HEADER]
    index = 0
    for label in range(43):
        for _ in range(test_per_class):
            w, h = int(rng.integers(20, 40)), int(rng.integers(20, 40))
            name = f"{index:05d}.ppm"
            _sign(rng, label, w, h).save(images / name)
            rows.append(f"{name};{w};{h};3;3;{w - 4};{h - 4};{label}")
            index += 1
    (root / "gtsrb" / "GT-final_test.csv").write_text("\r\n".join(rows) + "\r\n")
    return root
