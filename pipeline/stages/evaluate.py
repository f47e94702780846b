"""The evaluate stage: the model that ships, on the test split, as users send it; a quality gate.

It runs after the benchmark and measures what containerize puts into the image (`containerize.variant`; `auto` is
the benchmark's choice, models/serving.json), opened by the server's own loader (pipeline.serve.model: the same
runtime, session options and framing as `pipeline serve`). The headline `accuracy` is on the test split's original
files, whole, through the server's decode + preprocess; `roi_accuracy` (the ROI protocol, how papers report
benchmarks with boxes) on the prepared crops as the FP32 tensors deploy sends. The trained model (models/model.pt, torch eager) on
the same two inputs is reported beside them (`trained_accuracy`, `trained_roi_accuracy`, `trained_errors`): what
optimisation cost or gained.
Writes reports/evaluate/metrics.json (DVC metrics: accuracy, macro F1, per-class accuracy, the worst classes),
confusion.csv (one row per test image, `actual,predicted`: DVC's confusion plot), confusion.png, per_class.png,
predictions.json (artifacts.predictions: the shipped file's class for every test image and file, which deploy's
smoke test must get through the API, file for file), drift_reference.json (artifacts.drift_reference: the drift
signals of pipeline/monitoring/drift.py on the original files, which the image carries and `pipeline monitor --drift`
compares live traffic with), and logs all of it to one MLflow run.
The quality gate (reports/evaluate/gate.json, artifacts.gate) compares: the shipped variant within
`evaluate.max_drop` of the trained model on the same files, no worse than the registered `champion` (its MLflow
pyfunc model on this run's test files) by more than that, and above `evaluate.min_accuracy` where a recipe sets a
floor. A failed gate fails the stage after writing the record, and `pipeline serve` and containerize refuse the
variant; a passed one moves the registry's `champion` alias to it (`evaluate.champion`).
"""

from __future__ import annotations

import csv
from typing import Any

import numpy as np

from pipeline import console
from pipeline.artifacts import MODELS_DIR, REPORTS_DIR, drift_reference
from pipeline.artifacts import evaluation as evaluation_file
from pipeline.artifacts import gate as gate_file
from pipeline.artifacts import model as model_file
from pipeline.artifacts import predictions as predictions_file
from pipeline.artifacts.prepared import PREPARED_DIR, ModelInput, read_manifest, read_test_files
from pipeline.classification_metrics import compute_metrics
from pipeline.config import Params
from pipeline.errors import StageError
from pipeline.images.served_input import served_test_input
from pipeline.machine.memory_budget import Budget
from pipeline.tracking import stage_run

EVAL_REPORTS = REPORTS_DIR / "evaluate"


def classify(
    images: ModelInput, shipped: Any, trained: Any, batch_size: int, counts: Any | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(the shipped model's, the trained model's) class ids of every image, a batch at a time (memory: one
    batch): `shipped` is the model as the server runs it (ServedModel), `trained` a numpy function (torch_logits).
    The images and the shipped model's outputs go into the drift `counts` (drift.SignalCounts) when given."""
    shipped_ids, trained_ids = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for batch in images.batches(batch_size):
        probabilities = shipped.probabilities(batch)
        shipped_ids.append(probabilities.argmax(1).astype(np.int64))
        trained_ids.append(trained(batch).argmax(1).astype(np.int64))
        if counts is not None:
            counts.add_images(batch)
            counts.add_outputs(probabilities)
    return np.concatenate(shipped_ids), np.concatenate(trained_ids)


def drift_counts(classes: list[str], images: ModelInput, files: bool) -> Any:
    """drift.SignalCounts with the image sizes: the original test files' (else the prepared crops')."""
    from PIL import Image

    from pipeline.monitoring import drift

    counts = drift.SignalCounts(list(classes))
    sizes = []
    for original in read_test_files(PREPARED_DIR) if files else []:
        with Image.open(original.path) as image:
            sizes.append(image.size)
    side = read_manifest(PREPARED_DIR).image_size
    counts.add_sizes(sizes or [(side, side)] * len(images))
    return counts


def write_drift_reference(variant: str, version: str, counts: Any, images: int, files: bool) -> None:
    """The drift signals on the original test files (else the prepared crops), as the server counts them
    (pipeline/monitoring/drift.py)."""
    from pipeline.monitoring import drift

    what = "original test files through the server's decoding" if files else "prepared test crops (no original files)"
    drift_reference.write(drift.to_reference(counts, variant, version, f"{images} {what}"))


def torch_logits(model: Any) -> Any:
    """The trained torch model as a numpy function, without autograd."""
    import torch

    def logits(images: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(images)).numpy()

    return logits


def headline_metrics(
    labels: np.ndarray, roi: np.ndarray, served: np.ndarray | None, classes: list[str], worst: int
) -> dict[str, Any]:
    """The headline (`accuracy`, macro F1, per-class, confusion) on what users send: the whole original files
    through the server's preprocessing; the ROI-protocol figure (prepared crops, how papers report boxed data) beside
    it. Prepared data without original files (older, or a test's fake) falls back to the crops, and says so."""
    metrics = compute_metrics(labels, roi if served is None else served, classes, worst)
    correct_roi = int((roi == labels).sum())
    roi_accuracy = correct_roi / max(1, len(labels))
    extra: dict[str, Any] = {
        "measured_on": "prepared crops (no original files)" if served is None else "original files, whole",
        "roi_accuracy": roi_accuracy,
        "roi_errors": int(len(labels) - correct_roi),
    }
    if served is not None:
        extra["whole_vs_roi_gap_points"] = round(100 * (roi_accuracy - metrics["accuracy"]), 4)
    return {"accuracy": metrics.pop("accuracy"), **extra, **metrics}


def write_reports(labels: np.ndarray, preds: np.ndarray, metrics: dict[str, Any], classes: list[str]) -> None:
    EVAL_REPORTS.mkdir(parents=True, exist_ok=True)
    summary = {k: v for k, v in metrics.items() if k != "confusion_matrix"}
    evaluation_file.write(summary)
    with (EVAL_REPORTS / "confusion.csv").open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["actual", "predicted"])
        for a, p in zip(labels.tolist(), preds.tolist(), strict=True):
            writer.writerow([classes[a], classes[p]])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cm = np.asarray(metrics["confusion_matrix"], dtype=np.float64)
    rows = cm.sum(1, keepdims=True)
    norm = np.divide(cm, rows, out=np.zeros_like(cm), where=rows > 0)
    fig, ax = plt.subplots(figsize=(9, 8))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set(
        xlabel="predicted class",
        ylabel="actual class",
        title=f"Test confusion matrix (accuracy {metrics['accuracy']:.4f}, {metrics['errors']} errors)",
    )
    ticks = list(range(len(classes)))
    ax.set_xticks(ticks[::2])
    ax.set_yticks(ticks[::2])
    for i, j in zip(*np.nonzero((cm > 0) & ~np.eye(len(classes), dtype=bool)), strict=True):
        ax.text(j, i, str(int(cm[i, j])), ha="center", va="center", fontsize=6, color="red")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(EVAL_REPORTS / "confusion.png", dpi=110)
    plt.close(fig)

    # Per-class accuracy on the headline's input, worst first: the chart people open next to the confusion matrix.
    figures = sorted(metrics["per_class"].items(), key=lambda item: item[1]["accuracy"])
    fig, ax = plt.subplots(figsize=(9, max(4.0, 0.22 * len(figures))))
    ax.barh([name[:40] for name, _ in figures], [v["accuracy"] for _, v in figures], color="tab:blue")
    ax.set(xlim=(0, 1), xlabel="accuracy", title=f"Per-class accuracy ({metrics['measured_on']}), worst first")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    fig.savefig(EVAL_REPORTS / "per_class.png", dpi=110)
    plt.close(fig)


def champion_accuracy(
    params: Params, shipped_sha256: str, classes: list[str], batch_size: int
) -> gate_file.Champion | None:
    """The registered champion (another file than this run's) measured on this run's original test files through
    its MLflow pyfunc model, as any client loads it: artifacts.gate.Champion, or None (none yet, or no files)."""
    from pipeline.tracking import champion_version, quiet_mlflow_logging

    version = champion_version(params) if params.evaluate.champion else None
    files = read_test_files(PREPARED_DIR)
    if version is None or not files or version.tags.get("sha256") == shipped_sha256:
        return None
    import mlflow
    import pandas as pd

    try:
        with quiet_mlflow_logging():
            model = mlflow.pyfunc.load_model(f"models:/{params.tracking.registered_model_name}@champion")
    except Exception as exc:  # its artifacts gone, or not a model this package made: nothing to compare with
        console.log(
            f"WARNING: evaluate: the registered champion (version {version.version}) cannot be loaded, so this run "
            f"is not compared with it ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
            "`pipeline promote --version N` points the alias at a loadable version"
        )
        return None
    correct = 0
    for start in range(0, len(files), batch_size):
        chunk = files[start : start + batch_size]
        answers = model.predict(pd.DataFrame({"image": [f.path.read_bytes() for f in chunk]}))
        correct += sum(str(a) == classes[f.label] for a, f in zip(answers["class_name"], chunk, strict=True))
    return gate_file.Champion(
        version=str(version.version), variant=str(version.tags.get("variant", "")), accuracy=correct / len(files)
    )


def quality_gate(
    params: Params, metrics: dict[str, Any], sha256: str, champion: gate_file.Champion | None
) -> gate_file.Gate:
    """The comparative gate (and a recipe's floor) on one set of test files: artifacts.gate.Gate."""
    cfg = params.evaluate
    accuracy, trained = float(metrics["accuracy"]), float(metrics["trained_accuracy"])
    checks = [
        gate_file.GateCheck(
            name="trained",
            passed=accuracy >= trained - cfg.max_drop - 1e-12,
            detail=f"{metrics['variant']} {accuracy:.4f} against the trained model's {trained:.4f} on the same "
            f"files (evaluate.max_drop {cfg.max_drop})",
        )
    ]
    if cfg.min_accuracy > 0:
        checks.append(
            gate_file.GateCheck(
                name="floor",
                passed=accuracy >= cfg.min_accuracy,
                detail=f"test accuracy {accuracy:.4f} of {metrics['variant']} ({metrics['measured_on']}) against "
                f"evaluate.min_accuracy {cfg.min_accuracy:.4f} ({metrics['errors']} of {metrics['images']} test "
                "images wrong)",
            )
        )
    if champion is not None:
        checks.append(
            gate_file.GateCheck(
                name="champion",
                passed=accuracy >= champion.accuracy - cfg.max_drop - 1e-12,
                detail=f"{metrics['variant']} {accuracy:.4f} against the champion's {champion.accuracy:.4f} (version "
                f"{champion.version}, {champion.variant}) on the same files (evaluate.max_drop {cfg.max_drop})",
            )
        )
    return gate_file.Gate(
        passed=all(c.passed for c in checks),
        variant=str(metrics["variant"]),
        sha256=sha256,
        accuracy=accuracy,
        trained_accuracy=trained,
        images=int(metrics["images"]),
        checks=checks,
        champion=champion,
    )


def open_shipped(params: Params) -> Any:
    """The variant the image ships, through the server's loader on the backend the image runs."""
    from pipeline.runtimes import image_backend
    from pipeline.serve.model import load_served_model
    from pipeline.ship.context import choose_model

    shipped = choose_model(MODELS_DIR, params.containerize.variant)
    config = params.serve.model_copy(update={"variant": shipped.variant, "backend": image_backend(), "workers": 1})
    return load_served_model(MODELS_DIR, config), shipped.sha256


def run(params: Params) -> None:
    import torch

    cfg = params.evaluate
    model, payload = model_file.read()
    manifest = read_manifest(PREPARED_DIR)
    _check_size(
        f"{model_file.MODEL_PATH} was trained at", int(payload["arch"]["image_size"]), manifest.image_size, "train"
    )
    shipped, shipped_sha256 = open_shipped(params)
    _check_size(f"the shipped variant {shipped.variant} takes", shipped.image_size, manifest.image_size, "optimize")
    # Both networks run each batch: the trained one's layer outputs stand for the shipped one's (never larger).
    batch_size = Budget.of(params.memory_gb, model, manifest.image_size).eval_batch(
        cfg.batch_size, "evaluate.batch_size"
    )
    test = ModelInput.of_split("test", PREPARED_DIR)
    labels = test.labels
    classes = list(payload.get("classes") or manifest.classes)
    if len(test) and int(labels.max()) >= len(classes):
        raise StageError(f"{PREPARED_DIR / 'test'} has labels beyond the model's {len(classes)} classes")
    tags = {"evaluate": cfg.model_dump(), "model": payload["arch"], "variant": shipped.variant}
    with stage_run("evaluate", params, tags) as mlrun:
        mlrun.set_tags({"torch": torch.__version__, "variant": shipped.variant, "model_version": shipped.version})
        trained_logits = torch_logits(model)
        # The shipped file as the server runs it, and the trained model beside it: on the prepared crops (deploy's
        # FP32 tensors), and on the original files as the server decodes them (what the drift reference counts).
        originals = served_test_input(PREPARED_DIR, batch_size)
        counts = drift_counts(classes, originals or test, originals is not None)
        roi, trained_roi, served, trained = _classify_both(
            test, originals, not manifest.boxes, shipped, trained_logits, batch_size, counts
        )
        metrics = headline_metrics(labels, roi, served, classes, cfg.worst_classes)
        metrics = {
            "variant": shipped.variant,
            "model_version": shipped.version,
            **metrics,
            "trained_accuracy": float((trained == labels).mean()) if len(labels) else 0.0,
            "trained_roi_accuracy": float((trained_roi == labels).mean()) if len(labels) else 0.0,
            "trained_errors": int((trained != labels).sum()),
        }
        write_reports(labels, roi if served is None else served, metrics, classes)
        write_drift_reference(shipped.variant, shipped.version, counts, len(test), originals is not None)
        predictions_file.write(
            predictions_file.Predictions(
                variant=shipped.variant, model_version=shipped.version, classes=classes, labels=labels.tolist(),
                predicted=roi.tolist(), served_predicted=[] if served is None else served.tolist(),
            )
        )  # fmt: skip
        _log_results(mlrun, manifest, metrics, served is not None)
        _say(shipped.variant, metrics)
        champion = champion_accuracy(params, shipped_sha256, classes, batch_size)
        gate = quality_gate(params, metrics, shipped_sha256, champion)
        _record_gate(mlrun, gate, champion)
        if gate.passed:
            gate = _promote(params, mlrun, gate)
    if not gate.passed:
        raise StageError(
            f"quality gate failed, {shipped.variant} is not served: {gate.failures()} (see {gate_file.GATE_PATH})"
        )


def _classify_both(
    test: Any, originals: Any, no_boxes: bool, shipped: Any, trained_logits: Any, batch_size: int, counts: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """The shipped file's and the trained model's answers on the ROI arrays and on the original files as served
    (None without them); the drift counts are taken on what the server would see."""
    if originals is not None and no_boxes:  # no boxes: the ROI arrays are the served input, scored once
        served, trained = classify(originals, shipped, trained_logits, batch_size, counts)
        return served, trained, served, trained
    roi, trained_roi = classify(test, shipped, trained_logits, batch_size, counts if originals is None else None)
    if originals is None:
        return roi, trained_roi, None, trained_roi
    served, trained = classify(originals, shipped, trained_logits, batch_size, counts)
    return roi, trained_roi, served, trained


def _check_size(what: str, size: int, prepared_size: int, rerun: str) -> None:
    """The trained model and the shipped file take the prepared images' size (else: which stage to rerun)."""
    if size != prepared_size:
        raise StageError(
            f"{what} {size} px but {PREPARED_DIR} holds {prepared_size} px images: rerun `pipeline {rerun}`"
        )


def _log_results(mlrun: Any, manifest: Any, metrics: dict[str, Any], whole_files: bool) -> None:
    mlrun.log_dataset(
        manifest.dataset,
        PREPARED_DIR,
        manifest.content_sha256,
        {s: info.count for s, info in manifest.splits.items()},
        "evaluation",
    )
    mlrun.log_headline(
        {
            "test_accuracy": metrics["accuracy"],
            "test_roi_accuracy": metrics["roi_accuracy"],
            "test_macro_f1": metrics["macro_f1"],
        }
    )
    mlrun.log_metrics(
        {
            "test_errors": metrics["errors"],
            "trained_test_accuracy": metrics["trained_accuracy"],
            "trained_test_roi_accuracy": metrics["trained_roi_accuracy"],
            **({"whole_vs_roi_gap_points": metrics["whole_vs_roi_gap_points"]} if whole_files else {}),
        }
    )
    mlrun.log_metrics({f"class_accuracy/{v['class_id']:02d}": v["accuracy"] for v in metrics["per_class"].values()})
    for name in (
        "metrics.json",
        "confusion.csv",
        "confusion.png",
        "per_class.png",
        "predictions.json",
        "drift_reference.json",
    ):
        mlrun.log_artifact(EVAL_REPORTS / name, "reports")


def _say(variant: str, metrics: dict[str, Any]) -> None:
    worst = ", ".join(f"{w['name']} {w['accuracy']:.2f}" for w in metrics["worst_classes"] if w["accuracy"] < 1)
    console.log(
        f"{variant} (what the image ships): test accuracy {metrics['accuracy']:.4f} on "
        f"{metrics['measured_on']} ({metrics['errors']} errors in {metrics['images']}), macro F1 "
        f"{metrics['macro_f1']:.4f}; ROI crops {metrics['roi_accuracy']:.4f}; the trained model "
        f"{metrics['trained_accuracy']:.4f} / {metrics['trained_roi_accuracy']:.4f}"
        + (f"; worst: {worst}" if worst else "")
    )


def _record_gate(mlrun: Any, gate: Any, champion: Any) -> None:
    gate_file.write(gate)
    mlrun.log_artifact(gate_file.GATE_PATH, "reports")
    mlrun.set_tags({"gate": "passed" if gate.passed else "failed"})
    if champion is not None:
        mlrun.log_metrics({"champion_test_accuracy": champion.accuracy})
    for check in gate.checks:
        console.log(f"evaluate: gate {check.name} {'passed' if check.passed else 'FAILED'}: {check.detail}")


def _promote(params: Params, mlrun: Any, gate: gate_file.Gate) -> gate_file.Gate:
    """A passed gate moves the registry's champion where evaluate.promote allows it (the default branch); the gate
    record then says which version it moved to, or why not (the model card shows it)."""
    from pipeline.tracking import set_champion, why_not_promote

    reason = why_not_promote(params.evaluate.promote)
    version = None if reason else set_champion(params, gate.variant, gate.sha256)
    name = params.tracking.registered_model_name
    if reason:
        console.log(f"evaluate: the champion stays where it is ({reason}); `pipeline promote` moves it")
    elif version:
        console.log(f"evaluate: registry version {version} of {name} ({gate.variant}) is now the champion")
    else:
        reason = "no registry (tracking.enabled false) or no registered version of this file"
    mlrun.set_tags({"promoted": version or "no"})
    promoted = gate.model_copy(update={"promoted_version": version or "", "not_promoted": reason})
    gate_file.write(promoted)
    return promoted
