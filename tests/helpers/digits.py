"""A second real dataset, not the demo's: scikit-learn's bundled handwritten digits (1,797 8x8 scans of 10
digits), written as a folder of PNGs in the `data.source: folder` layout (ROOT/<digit>/<n>.png)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def write_digits_folder(root: Path) -> Path:
    from sklearn.datasets import load_digits

    digits = load_digits()
    for n, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        folder = root / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        grey = np.round(np.asarray(pixels) * (255.0 / 16.0)).astype(np.uint8)  # 0..16 ink levels -> 8 bits
        Image.fromarray(grey, "L").save(folder / f"{n:04d}.png")
    return root
