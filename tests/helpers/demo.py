"""The template's demo data set in the tests: a tiny synthetic GTSRB in torchvision's layout (train folders + CSVs,
test images + CSV), and the real sample when $GTSRB_ROOT names it. tests/conftest.py takes these fixtures in place
of its own that skip; a project generated without the demo has neither this file nor tests/demo/."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.images import picture

HEADER = "Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"


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
                picture(rng, label, w, h).save(folder / name)
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
            picture(rng, label, w, h).save(images / name)
            rows.append(f"{name};{w};{h};3;3;{w - 4};{h - 4};{label}")
            index += 1
    (root / "gtsrb" / "GT-final_test.csv").write_text("\r\n".join(rows) + "\r\n")
    return root


PHOTO_CLASSES = {"00001": "speed-30", "00002": "speed-50", "00012": "priority", "00013": "yield", "00014": "stop",
                 "00025": "roadworks"}  # fmt: skip


def write_photo_folder(gtsrb_root: Path, out: Path, per_class: int = 40) -> Path:
    """A folder of real photos in the `data.source: folder` layout, as a user would bring it: six classes of the
    sample's files (not drawn by us) with human class names, saved as JPEG and PNG at several sizes, some grey."""
    training = gtsrb_root / "gtsrb" / "GTSRB" / "Training"
    for folder, name in PHOTO_CLASSES.items():
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


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def synthetic_gtsrb(tmp_path: Path) -> Path:
    """The demo's source: the tests' kind of images in torchvision's GTSRB layout."""
    return write_synthetic_gtsrb(tmp_path / "raw")


@pytest.fixture(scope="session")
def real_gtsrb_root() -> Path:
    """The real GTSRB copy named by $GTSRB_ROOT (CI points it at the shared sample), else skip."""
    value = os.environ.get("GTSRB_ROOT")
    if not value:
        pytest.skip("no real GTSRB configured: set GTSRB_ROOT to a copy in torchvision's layout")
    root = Path(value)
    if not (root / "gtsrb" / "GTSRB" / "Training").is_dir():
        pytest.skip(f"GTSRB_ROOT={value} does not hold gtsrb/GTSRB/Training")
    return root


@pytest.fixture(scope="session")
def real_sample_data(real_gtsrb_root: Path) -> tuple[str, Path]:
    return "gtsrb", real_gtsrb_root


@pytest.fixture(scope="session")
def real_sample_test_files(real_gtsrb_root: Path) -> list[Path]:
    files = sorted((real_gtsrb_root / "gtsrb" / "GTSRB" / "Final_Test" / "Images").glob("*.ppm"))
    assert files, f"no test images under {real_gtsrb_root}"
    return files


@pytest.fixture(scope="session")
def real_photo_folder(real_gtsrb_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_photo_folder(real_gtsrb_root, tmp_path_factory.mktemp("real-photos") / "photos")
