"""The card stage: the model card of the shipped model, generated from the pipeline's artifacts.

    data/prepared/manifest.json      the data: classes, counts, split, checksum, framing
    reports/evaluate/metrics.json    served and ROI accuracy, per class, the worst classes
    reports/evaluate/predictions.json  which test files were confused with what (example confusions)
    models/manifest.json + serving.json  the shipped variant: size, accuracy, the benchmark's choice
    reports/benchmark/report.json    its speed against PyTorch's default eager, and the CPU it was measured on
        --> reports/model_card.md + model_card.json (artifacts.model_card), logged to MLflow; containerize puts
            them into the image and the server shows them at /v1/model-card.

Every figure is read, none typed: a card that disagrees with its sources (a stale evaluate) is an error.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pipeline import architectures
from pipeline.artifacts import MODELS_DIR, benchmark_report, model_card
from pipeline.artifacts import evaluation as evaluation_file
from pipeline.artifacts import predictions as predictions_file
from pipeline.artifacts import serving as serving_file
from pipeline.artifacts.prepared import PREPARED_DIR, DataSubject, PreparedManifest, read_manifest
from pipeline.artifacts.variants import TRAINED, ModelManifest, Variant
from pipeline.artifacts.variants import read_manifest as read_model_manifest
from pipeline.classification_metrics import compute_metrics
from pipeline.config import Params
from pipeline.console import log
from pipeline.errors import StageError
from pipeline.runtimes import image_backend
from pipeline.tracking import stage_run

EXAMPLES_PER_CONFUSION = 3
CONFUSIONS_PER_CLASS = 3
SMALL_QUANTILE = 0.25


def _gate() -> dict[str, Any] | None:
    """evaluate's gate record, when evaluate wrote one."""
    from pipeline.artifacts import gate as gate_file

    return gate_file.read().model_dump(mode="json") if gate_file.GATE_PATH.is_file() else None


def run(params: Params) -> None:
    prepared = read_manifest(PREPARED_DIR)
    evaluation = evaluation_file.read()
    predictions = predictions_file.read()
    manifest = read_model_manifest(MODELS_DIR)
    choice = serving_file.read(MODELS_DIR)
    if choice is None:
        raise StageError(serving_file.missing_choice(MODELS_DIR, "serve.variant"))
    report = benchmark_report.read()
    card = build(params, prepared, evaluation, predictions, manifest, choice, report.model_dump())
    path = model_card.write(card)
    with stage_run("card", params) as mlrun:
        mlrun.log_artifact(path, "model_card")
        mlrun.log_artifact(model_card.FACTS_PATH, "model_card")
    e = card.evaluation
    log(
        f"card: {path}: shipped {card.shipped.variant}, served accuracy {e.accuracy:.4f} of {e.model} (95 % CI "
        f"{e.accuracy_ci95[0]:.4f}-{e.accuracy_ci95[1]:.4f}; the trained model {e.trained_accuracy:.4f}), "
        f"{len(card.failure_modes)} known failure modes"
    )


def build(
    params: Params,
    prepared: PreparedManifest,
    evaluation: evaluation_file.EvaluationMetrics,
    predictions: predictions_file.Predictions,
    manifest: ModelManifest,
    choice: serving_file.ServingChoice,
    report: dict[str, Any],
) -> model_card.ModelCard:
    # evaluate measured the shipped variant: its figures are what the server answers (deploy's smoke test
    # reproduces them through the API, file for file); the trained model's are shown beside them.
    served_input = bool(predictions.served_predicted)
    predicted = predictions.served_predicted if served_input else predictions.predicted
    labels = predictions.labels
    variant = _measured_variant(evaluation, predictions, manifest, predicted)
    figures = compute_metrics(
        np.asarray(labels), np.asarray(predicted), predictions.classes, len(evaluation.worst_classes)
    )
    pairs = Counter((a, p) for a, p in zip(labels, predicted, strict=True) if a != p)
    per_class, worst = _class_results(prepared, figures, labels, predicted, pairs, predictions.classes)
    trained_macs = next((v.details.get("macs") for v in manifest.variants if v.name == TRAINED), None)
    return model_card.ModelCard(
        model_name=params.serve.model_name,
        architecture=manifest.architecture,
        initial_weights=manifest.initial_weights,
        num_classes=manifest.num_classes,
        image_size=manifest.image_size,
        image_size_reason=prepared.image_size_reason,
        recipe=_recipe(params),
        recipe_name=params.recipe,
        title=params.serve.title,
        gate=_gate(),
        data=_data_facts(prepared, params.train.train_on_val, params.name),
        evaluation=model_card.EvaluationFacts(
            model=f"the shipped variant `{variant.name}`",
            measured_on=evaluation.measured_on,
            images=figures["images"],
            accuracy=figures["accuracy"],
            accuracy_ci95=model_card.wilson_interval(figures["images"] - figures["errors"], figures["images"]),
            roi_accuracy=evaluation.roi_accuracy,
            macro_f1=figures["macro_f1"],
            errors=figures["errors"],
            per_class=per_class,
            worst=worst,
            trained_accuracy=evaluation.trained_accuracy,
            trained_roi_accuracy=evaluation.trained_roi_accuracy,
            trained_errors=evaluation.trained_errors,
        ),
        shipped=_shipped(variant, choice, report, made_from(variant, manifest.variants, trained_macs)),
        failure_modes=_failure_modes(
            prepared, figures, evaluation.roi_accuracy, labels, predicted, pairs, predictions.classes, served_input
        ),
    )


def _measured_variant(
    evaluation: evaluation_file.EvaluationMetrics,
    predictions: predictions_file.Predictions,
    manifest: ModelManifest,
    predicted: list[int],
) -> Variant:
    """The variant evaluate measured, once its two files agree with each other and with models/."""
    labels = predictions.labels
    correct = sum(int(a == p) for a, p in zip(labels, predicted, strict=True))
    if (
        len(labels) != evaluation.images
        or abs(correct / max(1, len(labels)) - evaluation.accuracy) > 1e-9
        or (evaluation.variant, evaluation.model_version) != (predictions.variant, predictions.model_version)
    ):
        raise StageError(
            f"{evaluation_file.METRICS_PATH} and {predictions_file.PREDICTIONS_PATH} disagree (a stale or "
            "interrupted evaluate): rerun `pipeline evaluate`"
        )
    variant = manifest.variant(predictions.variant)
    if variant.sha256[:12] != predictions.model_version:
        raise StageError(
            f"evaluate measured another {variant.name} file ({predictions.model_version}) than models/ holds "
            f"({variant.sha256[:12]}): rerun `pipeline evaluate`"
        )
    return variant


def _class_results(
    prepared: PreparedManifest,
    figures: dict[str, Any],
    labels: list[int],
    predicted: list[int],
    pairs: Counter[tuple[int, int]],
    classes: list[str],
) -> tuple[list[model_card.ClassResult], list[model_card.ClassResult]]:
    """Every class's result with what it was taken for (and example files), and the worst of them."""
    names = [Path(n).name for n in prepared.test_files] or [f"test image {i}" for i in range(len(labels))]
    train_counts = prepared.splits["train"].per_class

    def result(class_id: int, accuracy: float, support: int) -> model_card.ClassResult:
        confused = sorted(((p, n) for (a, p), n in pairs.items() if a == class_id), key=lambda x: (-x[1], x[0]))
        return model_card.ClassResult(
            class_id=class_id,
            name=classes[class_id],
            accuracy=accuracy,
            support=support,
            train_images=train_counts[class_id] if class_id < len(train_counts) else 0,
            confused_with=[
                model_card.Confusion(
                    predicted=classes[p],
                    count=n,
                    examples=[
                        names[i]
                        for i, (a, q) in enumerate(zip(labels, predicted, strict=True))
                        if (a, q) == (class_id, p)
                    ][:EXAMPLES_PER_CONFUSION],
                )
                for p, n in confused[:CONFUSIONS_PER_CLASS]
            ],
        )

    per_class = [result(c["class_id"], c["accuracy"], c["support"]) for c in figures["per_class"].values()]
    by_id = {c.class_id: c for c in per_class}
    return per_class, [by_id[w["class_id"]] for w in figures["worst_classes"] if w["class_id"] in by_id]


def _recipe(params: Params) -> dict[str, dict[str, object]]:
    """The sections that made the model; of `model`, only the keys its network reads (a timm network has no width)."""
    sections = {s: getattr(params, s).model_dump(mode="json") for s in ("model", "train", "augment", "regularize")}
    used = {"name", *architectures.settings_used(params.model.name)}
    sections["model"] = {k: v for k, v in sections["model"].items() if k in used}
    return sections


def _data_facts(prepared: PreparedManifest, trained_on_val: bool, name: str) -> model_card.DataFacts:
    # `name` is what the run is called (a photo folder's parent, not the "train" folder prepare read)
    return model_card.DataFacts(
        dataset=name,
        classes=prepared.classes,
        split_counts={name: split.count for name, split in prepared.splits.items()},
        train_per_class=prepared.splits["train"].per_class,
        validation=_validation(prepared, trained_on_val),
        content_sha256=prepared.content_sha256,
        unreadable_files=prepared.bad_images.count,
        framing=prepared.framing,
        crop=prepared.crop,
        boxes=prepared.boxes,
        resize=prepared.resize_mode,
        subject=prepared.subject,
    )


def _validation(prepared: PreparedManifest, trained_on: bool) -> str:
    val = prepared.splits.get("val")
    if val is None:
        return "none"
    if val.tracks:
        subject = prepared.subject or DataSubject(one="")
        split = (
            f"{val.tracks} {subject.groups} ({subject.group_is}, {val.count:,} images) split off whole: "
            "no track is in both splits"
        )
    else:
        split = f"{val.count:,} images split off by file, stratified by class"
    if trained_on:  # train.train_on_val
        return (
            f"{split}; recipes are chosen with it held out, and this model then trained on it too "
            "(`train.train_on_val`), so its only held-out figures are the test split's"
        )
    return f"{split}; held out from this model's training"


def made_from(variant: Any, variants: list[Any], trained_macs: Any) -> str:
    """One sentence on how the shipped network was made from the trained model, from optimize's variant details
    (an ONNX or int8 file's own details name only its source: followed back to the torch variant)."""
    by_name = {v.name: v for v in variants}
    seen = {variant.name}
    while not {"prune_amount", "student_width"} & set(variant.details) and variant.source in by_name:
        if variant.source in seen:
            break
        variant = by_name[variant.source]
        seen.add(variant.name)
    d = variant.details
    share = (
        f" ({100 * int(d['macs']) / int(trained_macs):.0f} % of its multiply-adds)"
        if d.get("macs") and trained_macs
        else ""
    )
    if "prune_amount" in d:
        members = int(d.get("prune_members", 0))
        which = "its first network" if members == 1 else f"its first {members} networks" if members else "it"
        return (
            f"Made from the trained model: {which}, pruned to {d.get('channels_after', '?')} channels{share}, "
            f"fine-tuned {d.get('finetune_epochs', '?')} epochs distilled from the whole model."
        )
    if "student_width" in d:
        return (
            f"Made from the trained model: a width-{d['student_width']} network{share} trained "
            f"{d.get('student_epochs', '?')} epochs on its outputs."
        )
    return "The trained model's own weights."


def _shipped(
    variant: Any, choice: serving_file.ServingChoice, report: dict[str, Any], made: str = ""
) -> model_card.ShippedFacts:
    # Speed figures are the benchmark's for its choice; a variant set by hand (containerize.variant) has none here.
    benchmarked = choice.variant == variant.name
    m = choice.metrics if benchmarked else {}
    default = benchmark_report.default_eager(report.get("results", []))
    rounds = report.get("headline") if benchmarked else None
    speedup = (
        round(rounds["median"], 2)
        if rounds
        else round(m["throughput_b32"] / default["metrics"]["throughput_b32"], 2)
        if default and "throughput_b32" in m
        else None
    )
    machine = report.get("machine", {})
    isa = " + ".join(f.upper() for f in machine.get("isa", [])) or "no vector extensions listed"
    return model_card.ShippedFacts(
        variant=variant.name,
        precision=variant.precision,
        format=variant.format,
        size_bytes=variant.size_bytes,
        parameters=variant.parameters,
        sha256=variant.sha256,
        served_accuracy=variant.served_accuracy,
        accuracy_drop_points=round(100 * variant.accuracy_drop, 2),
        made_from=made,
        backend=choice.backend if benchmarked else image_backend(),
        throughput_b32=m.get("throughput_b32"),
        p50_ms=m.get("p50_ms"),
        p99_ms=m.get("p99_ms"),
        speedup_vs_default_eager=speedup,
        speedup_range=(round(rounds["low"], 2), round(rounds["high"], 2)) if rounds else None,
        speedup_rounds=int(rounds["rounds"]) if rounds else 0,
        machine=f"{machine.get('cpu', 'unknown CPU')} ({machine.get('architecture', '?')}, {isa}, "
        f"{machine.get('usable_cores', machine.get('cores', '?'))} cores)",
    )


def _failure_modes(
    prepared: PreparedManifest,
    figures: dict[str, Any],
    roi_accuracy: float,
    labels: list[int],
    predicted: list[int],
    pairs: Counter[tuple[int, int]],
    classes: list[str],
    served_input: bool,
) -> list[str]:
    """What goes wrong, each with its measured figure."""
    modes = []
    support = Counter(labels)
    for (a, p), n in pairs.most_common(3):
        modes.append(f"{classes[a]} read as {classes[p]}: {n} of {support[a]} test images of that class.")
    if served_input and roi_accuracy > figures["accuracy"]:
        modes.append(
            f"Framing: {100 * figures['accuracy']:.2f} % on whole files against {100 * roi_accuracy:.2f} % "
            "when the sign's box is given (`/v1/predict` `box=`): send a box when you have one."
        )
    small = _small_image_accuracy(prepared, labels, predicted)
    if small is not None:
        modes.append(small)
    # Rare classes are a failure mode only where they measurably do worse than the headline.
    counts = prepared.splits["train"].per_class
    by_id = {c["class_id"]: c["accuracy"] for c in figures["per_class"].values()}
    rare = [i for i in sorted(range(len(counts)), key=lambda i: counts[i])[:5] if i in by_id]
    weak = [i for i in rare if by_id[i] < figures["accuracy"]]
    if weak:
        text = ", ".join(f"{classes[i]} ({counts[i]} images: {100 * by_id[i]:.1f} %)" for i in weak)
        modes.append(f"Among the five rarest training classes, below the headline: {text}.")
    return modes


def _small_image_accuracy(prepared: PreparedManifest, labels: list[int], predicted: list[int]) -> str | None:
    """Accuracy on the smallest quarter of the test files (by their shorter side) against the rest."""
    if not prepared.test_files or len(prepared.test_files) != len(labels) or len(labels) < 8:
        return None
    sides = []
    for name in prepared.test_files:
        try:
            with Image.open(PREPARED_DIR / name) as im:  # the header only: no pixels are decoded
                sides.append(min(im.size))
        except OSError:
            return None
    cut = sorted(sides)[int(SMALL_QUANTILE * (len(sides) - 1))]
    small = [i for i, s in enumerate(sides) if s <= cut]
    rest = [i for i, s in enumerate(sides) if s > cut]
    if not small or not rest:
        return None

    def accuracy(idx: list[int]) -> float:
        return sum(int(labels[i] == predicted[i]) for i in idx) / len(idx)

    return (
        f"Small images: {100 * accuracy(small):.2f} % on the {len(small)} test files of at most {cut} px on the shorter "
        f"side, against {100 * accuracy(rest):.2f} % on the other {len(rest)}."
    )
