"""A folder of real photos in the `data.source: folder` layout, as a user would bring it: six classes of the GTSRB
sample's files (not drawn by us) with human class names, saved as JPEG and PNG at several sizes, some greyscale."""

from __future__ import annotations

from pathlib import Path

from PIL import Image

CLASSES = {"00001": "speed-30", "00002": "speed-50", "00012": "priority", "00013": "yield", "00014": "stop",
           "00025": "roadworks"}  # fmt: skip


def write_photo_folder(gtsrb_root: Path, out: Path, per_class: int = 40) -> Path:
    training = gtsrb_root / "gtsrb" / "GTSRB" / "Training"
    for folder, name in CLASSES.items():
        target = out / name
        target.mkdir(parents=True, exist_ok=True)
        for i, source in enumerate(sorted((training / folder).glob("*.ppm"))[:per_class]):
            image = Image.open(source).convert("RGB")
            if i % 5 == 0:
                image = image.convert("L")  # some greyscale
            if i % 3 == 0:
                image = image.resize((image.width * 3, image.height * 2))  # any size, any aspect
            if i % 2 == 0:
                image.save(target / f"{i:03d}.jpg", quality=90)
            else:
                image.save(target / f"{i:03d}.png")
    return out
