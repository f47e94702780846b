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


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project folder after the real prepare -> train -> optimize stages on the tiny synthetic GTSRB:
    data/prepared, models/ (manifest + ONNX variants), as the server, benchmark and container consume."""
    import contextlib

    import yaml

    from pipeline import optimize, prepare, train

    base = tmp_path_factory.mktemp("tiny-project")
    raw = write_synthetic_gtsrb(base / "raw", tracks_per_class=3, frames_per_track=3, test_per_class=3)
    work = base / "project"
    work.mkdir()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"].update({"root": str(raw), "download": False})
    params.setdefault("model", {}).update({"name": "signnet", "width": 8})
    params.setdefault("train", {}).update({"epochs": 3, "batch_size": 64, "checkpoint_every": 0, "nproc": 1})
    params.setdefault("optimize", {}).update(
        {"prune_amount": 0.0, "int8_torch": False, "calibration_images": 64, "max_accuracy_drop": 0.05}
    )
    params["tracking"] = {"enabled": False}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    parsed = parse_params(params)
    with contextlib.chdir(work):
        old = os.environ.pop("GTSRB_ROOT", None)
        try:
            prepare.run(parsed)
            train.run(parsed)
            optimize.run(parsed)
        finally:
            if old is not None:
                os.environ["GTSRB_ROOT"] = old
    return work
