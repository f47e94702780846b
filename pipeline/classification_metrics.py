"""Classification metrics, one definition: evaluate's headline of the trained model and the model card's of the
shipped variant are computed by the same function, so the two can be compared figure for figure."""

from __future__ import annotations

from typing import Any

import numpy as np


def compute_metrics(labels: np.ndarray, preds: np.ndarray, classes: list[str], worst: int) -> dict[str, Any]:
    """Accuracy, macro F1 (over classes present in the labels or predictions), per-class accuracy
    (recall) for the classes present in the labels, the confusion matrix and the `worst` classes."""
    k = len(classes)
    cm = np.zeros((k, k), dtype=np.int64)
    np.add.at(cm, (labels.astype(np.int64), preds.astype(np.int64)), 1)
    support = cm.sum(1)
    predicted = cm.sum(0)
    tp = np.diag(cm)
    present = (support > 0) | (predicted > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        precision = np.where(predicted > 0, tp / np.maximum(predicted, 1), 0.0)
        recall = np.where(support > 0, tp / np.maximum(support, 1), 0.0)
        f1 = np.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
    per_class = {
        classes[i]: {"class_id": i, "accuracy": float(recall[i]), "support": int(support[i]), "f1": float(f1[i])}
        for i in range(k)
        if support[i] > 0
    }
    ranked = sorted((i for i in range(k) if support[i] > 0), key=lambda i: (recall[i], -support[i]))
    worst_classes = [
        {
            "class_id": i,
            "name": classes[i],
            "accuracy": float(recall[i]),
            "support": int(support[i]),
            "most_confused_with": classes[int(np.argmax(np.where(np.arange(k) == i, -1, cm[i])))]
            if recall[i] < 1
            else None,
        }
        for i in ranked[:worst]
    ]
    return {
        "accuracy": float(tp.sum() / max(1, len(labels))),
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "errors": int(len(labels) - tp.sum()),
        "images": len(labels),
        "per_class": per_class,
        "worst_classes": worst_classes,
        "confusion_matrix": cm.tolist(),
    }
