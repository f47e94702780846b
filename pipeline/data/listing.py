"""What a data source lists: labelled image files, their classes, and the files it left out (with why).

The general sources (`data.source`, the table in pipeline/data/sources.py), one Listing each:
- `folder`: one sub-folder per class, as torchvision's ImageFolder (ROOT/<class>/<file>); or ROOT/train/<class>/
  and ROOT/test/<class>/ when the data comes split.
- `csv`: a file with a header and the columns `path,label` and optionally `group` (frames of one object: kept on
  one side of every split), `box` ("x1 y1 x2 y2", inclusive pixels) and `split` (train|test); paths relative to
  the CSV's folder.

Classes come from the data: folder names or labels, sorted (numerically when they are all integers). Files that
are not images by their extension, hidden files and paths that lead outside the data's folder (symlinks, ../)
are left out, counted and listed; an image that does not decode is prepare's to count.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.artifacts.prepared import DataSubject
from pipeline.errors import StageError
from pipeline.images.preprocess import Box

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".ppm", ".pgm", ".pbm", ".bmp", ".webp", ".gif"})
MAX_CLASSES = 256  # labels are stored as uint8


@dataclass(frozen=True)
class SignFile:
    """One labelled image file."""

    path: Path
    label: int
    box: Box | None  # the object's box when the source gives one (the CSV's `box`); else None
    track: int  # group: frames of one physical object (a track, the CSV's `group`); -1 = its own group
    size: tuple[int, int] | None = None  # (width, height) when the source states it, with the box


@dataclass
class Listing:
    dataset: str
    classes: list[str]
    train: list[SignFile]
    test: list[SignFile] | None
    """None when the source has no test split: prepare holds one out (data.test_fraction)."""
    ignored: list[tuple[str, str]] = field(default_factory=list)
    """(file, why) of files left out before decoding: not an image, hidden, outside the data folder."""
    subject: DataSubject | None = None
    """What the images show, when the source knows (the model card's words)."""


def class_order(names: set[str]) -> list[str]:
    """Sorted class names: numerically when they are all integers (00002 before 00010), else by name."""
    if names and all(n.isdigit() for n in names):
        return sorted(names, key=lambda n: (int(n), n))
    return sorted(names)


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except (ValueError, OSError):
        return False
    return True


def _check_classes(classes: list[str], where: Path) -> None:
    if not classes:
        raise StageError(f"{where}: no classes found (data.source folder: one sub-folder of images per class)")
    if len(classes) > MAX_CLASSES:
        raise StageError(f"{where}: {len(classes)} classes; at most {MAX_CLASSES} are supported")


def _class_dirs(base: Path, root: Path, ignored: list[tuple[str, str]]) -> dict[str, Path]:
    """The class folders in `base` by name; anything else there noted in `ignored` with why."""
    found, real_root = {}, root.resolve()
    for d in sorted(base.iterdir()):
        if d.name.startswith("."):
            continue
        if not _inside(d, real_root):
            ignored.append((str(d.relative_to(root)), "leads outside the data folder"))
        elif d.is_dir():
            found[d.name] = d
        else:
            ignored.append((str(d.relative_to(root)), "not in a class folder"))
    return found


def _image_files(
    dirs: dict[str, Path], index: dict[str, int], root: Path, ignored: list[tuple[str, str]]
) -> list[SignFile]:
    """The image files under each class folder, labelled by `index`, in class order; others noted in `ignored`."""
    files, real_root = [], root.resolve()
    for name in index:
        if name not in dirs:
            continue
        for path in sorted(p for p in dirs[name].rglob("*") if not p.is_dir()):
            rel = str(path.relative_to(root))
            if any(part.startswith(".") for part in path.relative_to(dirs[name]).parts):
                continue  # .DS_Store, editor files: not data
            if not _inside(path, real_root):
                ignored.append((rel, "leads outside the data folder"))
            elif path.suffix.lower() not in IMAGE_SUFFIXES:
                ignored.append((rel, f"not an image file ({path.suffix or 'no extension'})"))
            else:
                files.append(SignFile(path, index[name], None, -1))
    return files


def list_folder(root: Path, download: bool = False) -> Listing:
    """ROOT/<class>/<images> (then no test split), or ROOT/train/<class>/ + ROOT/test/<class>/ (your data: nothing to
    download)."""
    root = Path(root)
    if not root.is_dir():
        raise StageError(f"data.root {root} is not a folder (data.source: folder wants ROOT/<class>/<images>)")
    split_layout = (root / "train").is_dir() and (root / "test").is_dir()
    ignored: list[tuple[str, str]] = []

    train_dirs = _class_dirs(root / "train" if split_layout else root, root, ignored)
    test_dirs = _class_dirs(root / "test", root, ignored) if split_layout else {}
    only_test = sorted(set(test_dirs) - set(train_dirs))
    if only_test:
        raise StageError(
            f"{root / 'test'}: classes with no training folder: {', '.join(only_test)} (a model cannot learn them)"
        )
    classes = class_order(set(train_dirs))
    _check_classes(classes, root)
    index = {name: i for i, name in enumerate(classes)}

    train = _image_files(train_dirs, index, root, ignored)
    empty = [name for name in classes if not any(f.label == index[name] for f in train)]
    if empty:
        raise StageError(f"{root}: class folders without images: {', '.join(empty)}")
    return Listing(
        root.name or str(root),
        classes,
        train,
        _image_files(test_dirs, index, root, ignored) if split_layout else None,
        ignored,
    )


def _parse_box(text: str, row: int, csv_path: Path) -> Box | None:
    if not text.strip():
        return None
    parts = text.replace(",", " ").split()
    try:
        x1, y1, x2, y2 = (int(float(p)) for p in parts)
    except ValueError:
        raise StageError(f"{csv_path}, row {row}: box {text!r} is not four numbers `x1 y1 x2 y2`") from None
    return (x1, y1, x2, y2)


def list_csv(csv_path: Path, download: bool = False) -> Listing:
    """A CSV with path,label[,group][,box][,split]; paths relative to its folder."""
    csv_path = Path(csv_path)
    if not csv_path.is_file():
        raise StageError(f"data.root {csv_path} is not a file (data.source: csv wants a CSV with path,label columns)")
    base = csv_path.parent
    real_base = base.resolve()
    with csv_path.open(newline="", encoding="utf-8-sig") as fh:
        reader = csv.DictReader(fh)
        columns = set(reader.fieldnames or [])
        missing = {"path", "label"} - columns
        if missing:
            raise StageError(
                f"{csv_path}: missing column(s) {', '.join(sorted(missing))}; the header needs path,label "
                f"(and optionally group, box, split); it has {', '.join(sorted(columns)) or 'none'}"
            )
        rows = list(reader)
    ignored: list[tuple[str, str]] = []
    records: list[tuple[Path, str, str, Box | None, str]] = []
    for n, row in enumerate(rows, start=2):
        rel, label = (row.get("path") or "").strip(), (row.get("label") or "").strip()
        if not rel or not label:
            raise StageError(f"{csv_path}, row {n}: empty path or label")
        split = (row.get("split") or "train").strip().lower() or "train"
        if split not in ("train", "test"):
            raise StageError(f"{csv_path}, row {n}: split {split!r} must be train or test")
        path = base / rel
        if not _inside(path, real_base):
            ignored.append((rel, "leads outside the CSV's folder"))
            continue
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            ignored.append((rel, f"not an image file ({path.suffix or 'no extension'})"))
            continue
        box = _parse_box(row.get("box") or "", n, csv_path)
        records.append((path, label, (row.get("group") or "").strip(), box, split))
    train_labels = {r[1] for r in records if r[4] == "train"}
    only_test = sorted({r[1] for r in records if r[4] == "test"} - train_labels)
    if only_test:
        raise StageError(
            f"{csv_path}: labels only in the test split: {', '.join(only_test)} (a model cannot learn them)"
        )
    classes = class_order(train_labels)
    _check_classes(classes, csv_path)
    index = {name: i for i, name in enumerate(classes)}
    groups: dict[str, int] = {}
    files: dict[str, list[SignFile]] = {"train": [], "test": []}
    for path, label, group, box, split in records:
        track = groups.setdefault(group, len(groups)) if group else -1
        files[split].append(SignFile(path, index[label], box, track))
    has_test = any(r[4] == "test" for r in records)
    return Listing(csv_path.stem, classes, files["train"], files["test"] if has_test else None, ignored)
