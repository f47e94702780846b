"""`python -m benchmarks frozen-probe`: the packaged backbone's frozen features under a linear head, on real scans."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from benchmarks import frozen_probe
from tests.helpers.digits import write_digits_folder


def _digits(root: Path, classes: int = 3, per_class: int = 16) -> Path:
    write_digits_folder(root / "all")
    for digit in range(classes):
        target = root / "folder" / str(digit)
        target.mkdir(parents=True)
        for f in sorted((root / "all" / str(digit)).iterdir())[:per_class]:
            shutil.copy(f, target / f.name)
    return root / "folder"


def test_each_file_is_scored_once_and_the_frozen_features_tell_digits_apart(tmp_path: Path) -> None:
    folder = _digits(tmp_path)
    out = tmp_path / "probe.json"
    assert frozen_probe.main([str(folder), "--sizes", "64", "--folds", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["side"] == 64 and row["scored"] == 48 and len(row["accuracy"]) == 6  # 3 decays, with and without mirrors
    assert max(row["accuracy"].values()) > 0.7  # three digits: chance is a third
    folds = frozen_probe.folds(frozen_probe.labelled_files(folder)[0], 2)
    assert set(folds.tolist()) == {0, 1}  # both folds hold files, so every file was held out once


def test_a_test_folder_is_scored_by_a_head_trained_on_the_whole_folder(tmp_path: Path) -> None:
    folder = _digits(tmp_path)
    test = tmp_path / "test"
    for digit in range(3):
        shutil.copytree(tmp_path / "all" / str(digit), test / str(digit), ignore=lambda d, names: sorted(names)[:-8])
    out = tmp_path / "probe.json"
    frozen_probe.main([str(folder), "--test", str(test), "--sizes", "64", "--resize", "stretch", "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert (row["trained"], row["scored"], row["resize"]) == (48, 24, "stretch")
    assert max(row["accuracy"].values()) > 0.7
