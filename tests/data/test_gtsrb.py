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
