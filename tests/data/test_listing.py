"""Bring your own data: the folder and CSV sources, their checks, and the prepare stage on them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.artifacts.prepared import read_split
from pipeline.data.listing import class_order, list_csv, list_folder
from pipeline.errors import StageError
from pipeline.stages import prepare
from tests.helpers.params import make_params


def _image(path: Path, colour: tuple[int, int, int], mode: str = "RGB", size: int = 20) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(abs(hash(str(path))) % 2**32)
    pixels = np.clip(np.array(colour)[None, None, :] + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    if mode == "I;16":
        grey = np.asarray(image.convert("L"), dtype=np.uint16) * 257  # 16-bit grey levels of the same picture
        image = Image.fromarray(grey)  # uint16: mode I;16
    elif mode != "RGB":
        image = image.convert(mode)
    image.save(path)
    return path


COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40), "fish": (40, 40, 200)}


def _folder(root: Path, per_class: int = 6) -> Path:
    for name, colour in COLOURS.items():
        for i in range(per_class):
            _image(root / name / f"{i}.png", colour)
    return root


def test_class_order_is_numeric_when_the_names_are_numbers() -> None:
    assert class_order({"10", "2", "00001"}) == ["00001", "2", "10"]
    assert class_order({"dog", "Cat", "ant"}) == ["Cat", "ant", "dog"]


def test_a_folder_lists_classes_from_its_sub_folders_and_leaves_out_what_is_not_data(tmp_path: Path) -> None:
    root = _folder(tmp_path / "pets")
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "cat" / ".DS_Store").write_bytes(b"\0")
    (root / "README.md").write_text("a file beside the class folders")
    outside = _image(tmp_path / "elsewhere" / "secret.png", (0, 0, 0))
    os.symlink(outside, root / "dog" / "link.png")
    listing = list_folder(root)
    assert listing.classes == ["cat", "dog", "fish"] and listing.dataset == "pets" and listing.test is None
    assert len(listing.train) == 18 and {f.label for f in listing.train} == {0, 1, 2}
    reasons = dict(listing.ignored)
    assert reasons["cat/notes.txt"].startswith("not an image file")
    assert reasons["dog/link.png"] == "leads outside the data folder"
    assert reasons["README.md"] == "not in a class folder"
    assert not any(".DS_Store" in name for name in reasons)


def test_folder_mistakes_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="is not a folder"):
        list_folder(tmp_path / "missing")
    root = _folder(tmp_path / "pets")
    (root / "bird").mkdir()
    with pytest.raises(StageError, match="class folders without images: bird"):
        list_folder(root)
    split = tmp_path / "split"
    _folder(split / "train")
    _image(split / "test" / "cat" / "0.png", COLOURS["cat"])
    _image(split / "test" / "zebra" / "0.png", (0, 0, 0))
    with pytest.raises(StageError, match="classes with no training folder: zebra"):
        list_folder(split)


def test_a_csv_lists_paths_labels_groups_boxes_and_splits(tmp_path: Path) -> None:
    rows = ["path,label,group,box,split"]
    for name, colour in COLOURS.items():
        for i in range(4):
            _image(tmp_path / "img" / f"{name}{i}.png", colour)
            rows.append(f"img/{name}{i}.png,{name},{name}-{i // 2},2 2 17 17,{'test' if i == 3 else 'train'}")
    rows.append("../outside.png,cat,,,train")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    listing = list_csv(tmp_path / "labels.csv")
    assert listing.classes == ["cat", "dog", "fish"] and listing.test is not None
    assert len(listing.train) == 9 and len(listing.test) == 3
    assert listing.train[0].box == (2, 2, 17, 17)
    assert listing.train[0].track == listing.train[1].track != listing.train[2].track  # group column
    assert listing.ignored == [("../outside.png", "leads outside the CSV's folder")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("file,class\na.png,cat\n", r"missing column\(s\) label, path"),
        ("path,label\na.png,\n", "row 2: empty path or label"),
        ("path,label,split\na.png,cat,valid\n", "split 'valid' must be train or test"),
        ("path,label,split\na.png,cat,train\nb.png,dog,test\n", "labels only in the test split: dog"),
        ("path,label,box\na.png,cat,1 2 three 4\n", "is not four numbers"),
    ],
)
def test_csv_mistakes_are_one_clear_line(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "labels.csv").write_text(content)
    with pytest.raises(StageError, match=message):
        list_csv(tmp_path / "labels.csv")


def test_prepare_on_a_folder_of_mixed_images(tmp_path: Path, workdir: Path) -> None:
    """Classes from the data, every image mode made RGB (16-bit grey scaled, not clipped), bad files counted,
    a duplicate across splits left out, a held-out test split with every class, and its original files kept."""
    root = _folder(tmp_path / "pets", per_class=10)
    modes = ["L", "RGBA", "P", "I;16", "1", "LA"]
    for mode in modes:
        _image(root / "fish" / f"mode-{mode.replace(';', '')}.png", COLOURS["fish"], mode)
    _image(root / "cat" / "photo.jpg", COLOURS["cat"], "CMYK")
    (root / "dog" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    Image.new("1", (5000, 5000)).save(root / "cat" / "huge.png")  # 25 MP in a few KB: refused by its header
    (root / "dog" / "copy-of-0.png").write_bytes((root / "dog" / "0.png").read_bytes())
    prepare.run(make_params(root, source="folder", image_size=16, max_bad_fraction=0.1, test_fraction=0.3))

    manifest = json.loads(Path("data/prepared/manifest.json").read_text())
    assert manifest["dataset"] == "pets" and manifest["classes"] == ["cat", "dog", "fish"]
    assert manifest["num_classes"] == 3 and manifest["crop"] == [0.0, 0.0, 0.0, 0.0]  # no boxes: whole images
    assert all(n > 0 for n in manifest["splits"]["train"]["per_class"])
    assert sum(manifest["splits"]["val"]["per_class"]) > 0 and sum(manifest["splits"]["test"]["per_class"]) > 0
    assert sorted(manifest["bad_images"]["files"]) == ["cat/huge.png", "dog/broken.png"]
    reasons = dict(line.split("\t") for line in Path("reports/prepare/bad_images.txt").read_text().splitlines())
    assert "larger than" in reasons["cat/huge.png"] and "decode" in reasons["dog/broken.png"]
    left_out = Path("reports/prepare/left_out.txt").read_text()
    duplicates = [line for line in left_out.splitlines() if "same bytes as" in line]
    assert len(duplicates) <= 1  # the copy and its original on different sides: the later one left out
    names = manifest["test_files"]
    assert len(names) == manifest["splits"]["test"]["count"] and len(set(names)) == len(names)
    assert all((Path("data/prepared") / n).is_file() for n in names)
    train = read_split("train", Path("data/prepared"))
    images, labels = train.images, train.labels
    fish = images[labels == 2].reshape(-1, 3).mean(axis=0)
    assert fish[2] > 60  # the 16-bit and 1-bit fish are not washed out to white: blue still dominates on average
    assert "cat" in Path("reports/prepare/class_distribution.csv").read_text()


def test_a_class_too_small_to_split_is_named(tmp_path: Path, workdir: Path) -> None:
    root = _folder(tmp_path / "pets")
    _image(root / "axolotl" / "only.png", (90, 90, 90))
    with pytest.raises(StageError, match=r"too few images to hold out a test split with every class: axolotl"):
        prepare.run(make_params(root, source="folder"))
