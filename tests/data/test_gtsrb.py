from pathlib import Path

import pytest

from pipeline.data.gtsrb import CLASS_NAMES, list_split
from pipeline.errors import StageError


def test_class_names() -> None:
    assert len(CLASS_NAMES) == 43
    assert CLASS_NAMES[14] == "Stop"


def test_lists_train_with_boxes_tracks_and_labels(synthetic_gtsrb: Path) -> None:
    files = list_split(synthetic_gtsrb, "train")
    assert len(files) == 43 * 3 * 2
    assert {f.label for f in files} == set(range(43))
    assert {f.track for f in files} == {0, 1, 2}
    first = next(f for f in files if f.label == 7)
    assert first.path.parent.name == "00007" and first.box is not None and first.box[:2] == (3, 3)


def test_lists_test_split_with_labels_from_the_official_csv(synthetic_gtsrb: Path) -> None:
    files = list_split(synthetic_gtsrb, "test")
    assert len(files) == 86
    assert [f.label for f in files[:4]] == [0, 0, 1, 1]
    assert all(f.track == -1 and f.box is not None for f in files)


def test_missing_dataset_says_how_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(StageError) as info:
        list_split(tmp_path / "nowhere", "train", download=False)
    message = str(info.value)
    assert "GTSRB train split not found" in message
    assert "GTSRB_ROOT" in message and "data.download" in message


def test_real_sample_matches_its_readme(real_gtsrb_root: Path) -> None:
    train = list_split(real_gtsrb_root, "train")
    test = list_split(real_gtsrb_root, "test")
    assert {f.label for f in train} == set(range(43)) == {f.label for f in test}
    assert all(f.box is not None for f in train + test)
    assert len(test) >= 645


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_listing_is_torchvisions_in_its_order(synthetic_gtsrb: Path, split: str) -> None:
    """Read without torchvision (prepare need not import torch), the same files in the same order: the prepared
    splits, and so every figure, stay as they were."""
    from torchvision.datasets import GTSRB

    listed = [(str(f.path), f.label) for f in list_split(synthetic_gtsrb, split)]
    theirs = list(GTSRB(root=str(synthetic_gtsrb), split=split)._samples)
    assert [path for path, _ in listed] == [path for path, _ in theirs]
    if split == "test":
        assert listed == theirs


def test_a_missing_test_csv_is_one_line(synthetic_gtsrb: Path) -> None:
    (synthetic_gtsrb / "gtsrb" / "GT-final_test.csv").unlink()
    with pytest.raises(StageError, match="GTSRB test labels unreadable"):
        list_split(synthetic_gtsrb, "test")
