"""`pipeline bench accuracy` on labelled files gives evaluate's served figure for the same files."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from pipeline.bench import accuracy
from pipeline.errors import StageError


def test_the_test_files_score_what_evaluate_reported(tiny_project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.artifacts.prepared import read_test_files

    originals = read_test_files(tiny_project / "data" / "prepared")
    labels = tiny_project / "labels.csv"
    labels.write_text("Path,ClassId\n" + "".join(f"{f.path.name},{f.label}\n" for f in originals))
    with contextlib.chdir(tiny_project):
        assert accuracy.main(["--csv", str(labels), "--images", str(originals[0].path.parent)]) == 0
    report = json.loads(capsys.readouterr().out)
    evaluated = json.loads((tiny_project / "reports/evaluate/metrics.json").read_text())
    assert report["images"] == len(originals)
    assert report["served"]["accuracy"] == round(evaluated["accuracy"], 4)
    assert report["served"]["ci95"][0] <= report["served"]["accuracy"] <= report["served"]["ci95"][1]
    assert "roi" not in report  # no boxes in this CSV

    # A shipped variant through the server's runtime interface: optimize's served figure for it.
    from pipeline.runtimes import read_manifest

    with contextlib.chdir(tiny_project):
        assert (
            accuracy.main(["--csv", str(labels), "--images", str(originals[0].path.parent), "--variant", "fp32-onnx"])
            == 0
        )
    report = json.loads(capsys.readouterr().out)
    served = read_manifest(tiny_project / "models").variant("fp32-onnx").served_accuracy
    assert report["model"] == "fp32-onnx" and report["served"]["accuracy"] == round(float(served or 0), 4)

    empty = tiny_project / "empty.csv"
    empty.write_text("Path,ClassId\n")
    with pytest.raises(StageError, match="no labelled rows"):
        accuracy.read_labels(empty, tiny_project, set())
