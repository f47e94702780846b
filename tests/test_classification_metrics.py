"""Classification metrics (evaluate's headline and the model card's)."""

import numpy as np
import pytest

from pipeline.classification_metrics import compute_metrics


def test_metrics_by_hand() -> None:
    classes = ["a", "b", "c"]
    labels = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    preds = np.array([0, 0, 0, 1, 1, 1, 2, 0])
    m = compute_metrics(labels, preds, classes, worst=2)
    assert m["accuracy"] == pytest.approx(6 / 8)
    assert m["errors"] == 2
    f1 = [2 * 0.75 * 0.75 / 1.5, 2 * (2 / 3) * 1 / (2 / 3 + 1), 2 * 1 * 0.5 / 1.5]
    assert m["macro_f1"] == pytest.approx(sum(f1) / 3)
    assert m["per_class"]["c"]["accuracy"] == 0.5
    assert [w["name"] for w in m["worst_classes"]] == ["c", "a"]
    assert m["worst_classes"][0]["most_confused_with"] == "a"
    assert m["confusion_matrix"] == [[3, 1, 0], [0, 2, 0], [1, 0, 1]]
