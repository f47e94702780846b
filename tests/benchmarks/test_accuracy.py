"""`python -m benchmarks accuracy` on labelled files gives evaluate's served figure for the same files."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from benchmarks import accuracy
from pipeline.errors import StageError


def test_the_test_files_score_what_evaluate_reported(
    benchmarked_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.artifacts.prepared import read_test_files

    tiny_project = benchmarked_project

    originals = read_test_files(tiny_project / "data" / "prepared")
    labels = tiny_project / "labels.csv"
    labels.write_text("Path,ClassId\n" + "".join(f"{f.path.name},{f.label}\n" for f in originals))
    with contextlib.chdir(tiny_project):
        assert accuracy.main(["--csv", str(labels), "--images", str(originals[0].path.parent)]) == 0
    report = json.loads(capsys.readouterr().out)
    evaluated = json.loads((tiny_project / "reports/evaluate/metrics.json").read_text())
    assert report["images"] == len(originals)
    # Without --variant: the trained model (evaluate's `trained_accuracy` on the same files).
    assert report["served"]["accuracy"] == round(evaluated["trained_accuracy"], 4)
    assert report["served"]["ci95"][0] <= report["served"]["accuracy"] <= report["served"]["ci95"][1]
    assert "roi" not in report  # no boxes in this CSV

    # The shipped variant through the server's runtime interface: evaluate's headline (and optimize's record).
    from pipeline.runtimes import read_manifest

    shipped = evaluated["variant"]
    with contextlib.chdir(tiny_project):
        assert (
            accuracy.main(["--csv", str(labels), "--images", str(originals[0].path.parent), "--variant", shipped]) == 0
        )
    report = json.loads(capsys.readouterr().out)
    served = read_manifest(tiny_project / "models").variant(shipped).served_accuracy
    assert report["model"] == shipped and report["served"]["accuracy"] == round(evaluated["accuracy"], 4)
    assert report["served"]["accuracy"] == round(float(served or 0), 4)

    empty = tiny_project / "empty.csv"
    empty.write_text("Path,ClassId\n")
    with pytest.raises(StageError, match="no labelled rows"):
        accuracy.read_labels(empty, tiny_project, set())
