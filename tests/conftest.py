"""Shared fixtures: a tiny synthetic GTSRB in torchvision's layout, the real sample when configured."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.config import Params, TrackingConfig, parse_params

REPO = Path(__file__).resolve().parent.parent
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


@pytest.fixture
def synthetic_gtsrb(tmp_path: Path) -> Path:
    return write_synthetic_gtsrb(tmp_path / "raw")


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty project directory as the working directory (stages write relative to it)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("GTSRB_ROOT", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return work


def make_params(root: Path, tracking: bool = False, **data: object) -> Params:
    """Params for a test run: the repo's params.yaml with data.root and overrides applied."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update({"root": str(root), "download": False, **data})
    raw["tracking"] = TrackingConfig(enabled=tracking).model_dump()
    return parse_params(raw)


@pytest.fixture
def real_gtsrb_root() -> Path:
    """The real GTSRB copy named by $GTSRB_ROOT (CI points it at the shared sample), else skip."""
    value = os.environ.get("GTSRB_ROOT")
    if not value:
        pytest.skip("no real GTSRB configured: set GTSRB_ROOT to a copy in torchvision's layout")
    root = Path(value)
    if not (root / "gtsrb" / "GTSRB" / "Training").is_dir():
        pytest.skip(f"GTSRB_ROOT={value} does not hold gtsrb/GTSRB/Training")
    return root
