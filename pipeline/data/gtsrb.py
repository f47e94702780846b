"""GTSRB on disk in torchvision's layout (torchvision downloads it), the official CSVs give the ROI boxes."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from pipeline.artifacts.prepared import DataSubject
from pipeline.data.listing import Listing, SignFile
from pipeline.errors import StageError
from pipeline.images.preprocess import Box

CLASS_NAMES: tuple[str, ...] = (
    "Speed limit (20km/h)",
    "Speed limit (30km/h)",
    "Speed limit (50km/h)",
    "Speed limit (60km/h)",
    "Speed limit (70km/h)",
    "Speed limit (80km/h)",
    "End of speed limit (80km/h)",
    "Speed limit (100km/h)",
    "Speed limit (120km/h)",
    "No passing",
    "No passing for vehicles over 3.5 metric tons",
    "Right-of-way at the next intersection",
    "Priority road",
    "Yield",
    "Stop",
    "No vehicles",
    "Vehicles over 3.5 metric tons prohibited",
    "No entry",
    "General caution",
    "Dangerous curve to the left",
    "Dangerous curve to the right",
    "Double curve",
    "Bumpy road",
    "Slippery road",
    "Road narrows on the right",
    "Road work",
    "Traffic signals",
    "Pedestrians",
    "Children crossing",
    "Bicycles crossing",
    "Beware of ice/snow",
    "Wild animals crossing",
    "End of all speed and passing limits",
    "Turn right ahead",
    "Turn left ahead",
    "Ahead only",
    "Go straight or right",
    "Go straight or left",
    "Keep right",
    "Keep left",
    "Roundabout mandatory",
    "End of no passing",
    "End of no passing by vehicles over 3.5 metric tons",
)
NUM_CLASSES = len(CLASS_NAMES)

LAYOUT_HELP = (
    "expected torchvision's layout: ROOT/gtsrb/GTSRB/Training/000NN/TTTTT_FFFFF.ppm with GT-000NN.csv, "
    "ROOT/gtsrb/GTSRB/Final_Test/Images/NNNNN.ppm and ROOT/gtsrb/GT-final_test.csv. "
    "Get it with data.download: true on a machine with internet access, "
    "or point data.root (or the GTSRB_ROOT environment variable) at an existing copy"
)


Annotation = tuple[Box, int, tuple[int, int] | None]  # ROI box, ClassId, (Width, Height)


def _read_boxes(csv_path: Path) -> dict[str, Annotation]:
    """Filename -> (ROI box, ClassId, image size) from one of GTSRB's semicolon-separated annotation files."""
    boxes: dict[str, Annotation] = {}
    if not csv_path.is_file():
        return boxes
    with csv_path.open(newline="") as f:
        for row in csv.DictReader(f, delimiter=";"):
            try:
                box = (int(row["Roi.X1"]), int(row["Roi.Y1"]), int(row["Roi.X2"]), int(row["Roi.Y2"]))
                label = int(row["ClassId"])
            except (KeyError, TypeError, ValueError):
                continue  # a malformed row: the image is still used, uncropped
            try:
                size: tuple[int, int] | None = (int(row["Width"]), int(row["Height"]))
            except (KeyError, TypeError, ValueError):
                size = None
            boxes[row["Filename"]] = (box, label, size)
    return boxes


def _target_folder(root: Path, split: str) -> Path:
    return root / "gtsrb" / "GTSRB" / ("Training" if split == "train" else "Final_Test/Images")


def _listed_samples(root: Path, split: str) -> list[tuple[str, int]]:
    """(path, label) of every image of `split`, in torchvision's order (its GTSRB dataset and `make_dataset`: class
    folders sorted, then each folder's walk sorted; the test split as its CSV lists it), read without importing
    torchvision (with torch, seconds of every prepare)."""
    folder = _target_folder(root, split)
    if split != "train":
        try:
            with open(root / "gtsrb" / "GT-final_test.csv", newline="") as csv_file:
                rows = csv.DictReader(csv_file, delimiter=";", skipinitialspace=True)
                return [(str(folder / row["Filename"]), int(row["ClassId"])) for row in rows]
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise StageError(f"GTSRB test labels unreadable under {root} ({exc}): {LAYOUT_HELP}") from exc
    classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
    samples = []
    for index, name in enumerate(classes):
        for directory, _, names in sorted(os.walk(folder / name, followlinks=True)):
            samples += [(os.path.join(directory, n), index) for n in sorted(names) if n.lower().endswith(".ppm")]
    return samples


def _samples(root: Path, split: str, download: bool) -> list[tuple[str, int]]:
    if _target_folder(root, split).is_dir():
        return _listed_samples(root, split)
    if not download:
        raise StageError(f"GTSRB {split} split not found under {root}: {LAYOUT_HELP}")
    from torchvision.datasets import GTSRB  # only to download it

    try:
        GTSRB(root=str(root), split=split, download=True)
    except Exception as exc:  # a download without network fails in many ways (URLError, SSL, HTTP...)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise StageError(
            f"could not download GTSRB into {root} ({reason}). Set data.download: false and {LAYOUT_HELP}"
        ) from exc
    return _listed_samples(root, split)


def list_split(root: Path, split: str, download: bool = False) -> list[SignFile]:
    """Every image of one split with its label, ROI box and track."""
    samples = _samples(root, split, download)
    if not samples:
        raise StageError(f"GTSRB {split} split under {root} holds no .ppm images: {LAYOUT_HELP}")
    files: list[SignFile] = []
    if split == "train":
        by_folder: dict[Path, dict[str, Annotation]] = {}
        for path_str, _ in samples:
            path = Path(path_str)
            folder = path.parent
            if folder not in by_folder:
                by_folder[folder] = _read_boxes(folder / f"GT-{folder.name}.csv")
            # The class is the folder's number (torchvision counts folders, which agrees on the full set).
            label = int(folder.name)
            annotation = by_folder[folder].get(path.name)
            track = int(path.stem.split("_")[0]) if "_" in path.stem else -1
            box, size = (annotation[0], annotation[2]) if annotation else (None, None)
            files.append(SignFile(path, label, box, track, size))
    else:
        boxes = _read_boxes(root / "gtsrb" / "GT-final_test.csv")
        for path_str, label in samples:
            path = Path(path_str)
            annotation = boxes.get(path.name)
            box, size = (annotation[0], annotation[2]) if annotation else (None, None)
            files.append(SignFile(path, label, box, -1, size))
    bad_labels = sorted({f.label for f in files if not 0 <= f.label < NUM_CLASSES})
    if bad_labels:
        raise StageError(f"GTSRB {split} split under {root} has class ids outside 0..42: {bad_labels}")
    return files


def listing(root: Path, download: bool = False) -> Listing:
    """data.source gtsrb: the training and the official test split, 43 classes."""
    return Listing(
        "GTSRB",
        list(CLASS_NAMES),
        list_split(root, "train", download),
        list_split(root, "test", download),
        subject=SUBJECT,
    )


SUBJECT = DataSubject(
    one="traffic sign, framed as in GTSRB: the sign fills most of the image",
    groups="tracks",
    group_is="physical signs",
    untested="other countries' signs, night, rain or video",
)
