"""The evaluate stage: metrics, reports and the quality gate's message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import nets
from pipeline.artifacts import model as model_file
from pipeline.artifacts import predictions as predictions_file
from pipeline.errors import StageError
from pipeline.stages import evaluate
from tests.helpers.params import train_params
from tests.helpers.prepared import write_prepared


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_prepared(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def save_untrained_model(root: Path) -> None:
    torch.manual_seed(0)
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=8)
    arch = nets.arch_kwargs("signnet", 16, width=8)
    classes = [f"class {i}" for i in range(43)]
    model_file.write(root / model_file.MODEL_PATH, arch, [0.5] * 3, [0.25] * 3, classes, model.state_dict())


def test_reports_and_gate_failure_message(project: Path) -> None:
    save_untrained_model(project)
    raw = train_params().model_dump(mode="json")
    raw["evaluate"] = {"min_accuracy": 0.99, "worst_classes": 3, "batch_size": 64}
    params = type(train_params()).model_validate(raw)
    with pytest.raises(StageError) as failure:
        evaluate.run(params)
    message = str(failure.value)
    assert message.startswith("quality gate failed: test accuracy 0.")
    assert "is below evaluate.min_accuracy 0.9900" in message and "\n" not in message
    metrics = json.loads((project / "reports/evaluate/metrics.json").read_text())
    assert set(metrics) >= {"accuracy", "macro_f1", "per_class", "worst_classes"}
    assert len(metrics["worst_classes"]) == 3
    rows = (project / "reports/evaluate/confusion.csv").read_text().splitlines()
    assert rows[0] == "actual,predicted" and len(rows) == 1 + 86
    written = predictions_file.read(project / predictions_file.PREDICTIONS_PATH)  # what deploy must reproduce
    assert len(written.predicted) == 86 and written.accuracy == metrics["accuracy"]
    assert [
        f"{written.classes[a]},{written.classes[p]}" for a, p in zip(written.labels, written.predicted, strict=True)
    ] == rows[1:]
    assert (project / "reports/evaluate/confusion.png").stat().st_size > 0
    assert (project / "reports/evaluate/per_class.png").stat().st_size > 0


def test_gate_passes_when_met(project: Path) -> None:
    save_untrained_model(project)
    evaluate.run(train_params())  # min_accuracy 0: reports written, no error
    assert (project / "reports/evaluate/metrics.json").exists()


def test_missing_model_is_a_stage_error(project: Path) -> None:
    with pytest.raises(StageError, match="run `pipeline train` first"):
        evaluate.run(train_params())


def test_served_accuracy_is_measured_on_the_original_files_through_the_servers_decode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evaluate's served figure comes from the test split's original files, whole (no box), through the very
    function the server decodes requests with; nothing else feeds it."""
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.serve import protocol

    write_prepared(tmp_path, originals=True)
    monkeypatch.chdir(tmp_path)
    save_untrained_model(tmp_path)
    seen: list[tuple[bytes, object]] = []
    server_decode = protocol.decode_images

    def spy(images: list[tuple[bytes, object]], *args: object) -> np.ndarray:
        seen.extend(images)
        return server_decode(images, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(protocol, "decode_images", spy)
    evaluate.run(train_params())
    originals = read_test_files(tmp_path / "data" / "prepared")
    assert seen == [(f.read_bytes(), None) for f in originals]
    metrics = json.loads((tmp_path / "reports/evaluate/metrics.json").read_text())
    written = predictions_file.read(tmp_path / predictions_file.PREDICTIONS_PATH)
    served = np.asarray(written.served_predicted)
    # The headline (and the gate) is the served figure; the ROI-protocol one is reported beside it.
    assert len(served) == len(originals) == metrics["images"] == 86
    assert metrics["measured_on"] == "original files, whole"
    assert metrics["accuracy"] == float((served == np.asarray(written.labels)).mean())
    assert metrics["roi_accuracy"] == float((np.asarray(written.predicted) == np.asarray(written.labels)).mean())
    assert metrics["whole_vs_roi_gap_points"] == round(100 * (metrics["roi_accuracy"] - metrics["accuracy"]), 4)
    with pytest.raises(StageError, match=r"quality gate failed: test accuracy .* \(original files, whole\)"):
        params = train_params()
        evaluate.run(params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"min_accuracy": 0.99})}))
