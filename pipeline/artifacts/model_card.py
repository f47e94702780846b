"""reports/model_card.md (+ model_card.json, the same facts as data): what the shipped model is for, what data it
saw, how it does per class and where it fails, how it was optimised. Written by the card stage from the other
stages' artifacts (never typed by hand), logged to MLflow, copied into the server image and served at
/v1/model-card. Sections follow "Model Cards for Model Reporting" (Mitchell et al., 2019) and Hugging Face's
model card template.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_model, write_text_atomic
from pipeline.artifacts.prepared import DataSubject

CARD_PATH = REPORTS_DIR / "model_card.md"
FACTS_PATH = REPORTS_DIR / "model_card.json"
RERUN = "run `pipeline card` (or `dvc repro card`)"


class _Facts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DataFacts(_Facts):
    dataset: str
    classes: list[str]
    split_counts: dict[str, int]
    """Images per split (train, val, test)."""
    train_per_class: list[int]
    validation: str
    """How the validation split was held out."""
    content_sha256: str
    """The prepared data's checksum (data/prepared/manifest.json)."""
    unreadable_files: int
    framing: str
    crop: tuple[float, float, float, float]
    boxes: bool = True
    """Whether the test files carry object boxes: without them there is no ROI protocol to report."""
    resize: str = "stretch"
    """How the server makes the image square (data.resize): stretch | center_crop | pad."""
    subject: DataSubject | None = None
    """What the images show, when the data source says (intended use and limits)."""


class Confusion(_Facts):
    predicted: str
    count: int
    examples: list[str]
    """Test files (names under the prepared test_files/) that were classified this way."""


class ClassResult(_Facts):
    class_id: int
    name: str
    accuracy: float
    support: int
    train_images: int
    confused_with: list[Confusion]


class EvaluationFacts(_Facts):
    model: str
    """Whose figures these are: the shipped variant's, as evaluate measured it through the server's loader."""
    measured_on: str
    images: int
    accuracy: float
    accuracy_ci95: tuple[float, float]
    """Wilson score interval of `accuracy` over `images`."""
    roi_accuracy: float
    macro_f1: float
    errors: int
    per_class: list[ClassResult]
    worst: list[ClassResult]
    trained_accuracy: float | None = None
    """The trained model before optimisation, on the same input (evaluate's `trained_accuracy`)."""
    trained_roi_accuracy: float | None = None
    trained_errors: int | None = None


class ShippedFacts(_Facts):
    variant: str
    precision: str
    format: str
    size_bytes: int
    parameters: int
    sha256: str
    served_accuracy: float | None
    """The shipped variant on the original test files through the server's preprocessing."""
    accuracy_drop_points: float
    """The trained model's top-1 on optimize's gate images minus the shipped variant's (points)."""
    made_from: str = ""
    """How the shipped network was made from the trained model (its weights, or pruned / distilled)."""
    backend: str
    throughput_b32: float | None
    p50_ms: float | None
    p99_ms: float | None
    speedup_vs_default_eager: float | None
    """Throughput at batch 32 against PyTorch's default eager fp32 (oneDNN on, the better thread count): the median
    of the benchmark's interleaved rounds when it timed them, else one pair of measurements."""
    speedup_range: tuple[float, float] | None = None
    """The lowest and highest ratio of those rounds."""
    speedup_rounds: int = 0
    """How many interleaved rounds the ratio is the median of (0: one pair of measurements)."""
    machine: str
    """The CPU kind the speed figures were measured on."""


class ModelCard(_Facts):
    model_name: str
    architecture: str
    initial_weights: dict[str, Any] | None = None
    """torchvision/timm networks: the weights training started from (source, file, sha256, licence)."""
    num_classes: int
    image_size: int
    image_size_reason: str = ""
    """Why the input side is not data.image_size (the time budget chose it); empty when it is."""
    recipe: dict[str, dict[str, object]]
    """The params sections that made the model: model (the keys its network reads), train, augment, regularize."""
    recipe_name: str = ""
    """The recipe under params.yaml's keys (a built-in one, or a file of yours)."""
    title: str = ""
    """The API's title (serve.title): the card's heading."""
    gate: dict[str, Any] | None = None
    """evaluate's quality gate record (artifacts.gate): its checks, and the champion it was compared with."""
    data: DataFacts
    evaluation: EvaluationFacts
    shipped: ShippedFacts
    failure_modes: list[str]


def gate_lines(gate: dict[str, Any] | None) -> list[str]:
    """evaluate's quality gate: each check with its figures, and the champion this variant was compared with."""
    if not gate:
        return []
    lines = [
        f"- Quality gate: **{'passed' if gate.get('passed') else 'failed'}**"
        + ("; no registered champion to compare with (a first run)." if not gate.get("champion") else ".")
    ]
    lines += [
        f"  - {c['name']}: {'passed' if c['passed'] else 'FAILED'}, {c['detail']}" for c in gate.get("checks", [])
    ]
    if gate.get("promoted_version"):
        lines.append(f"  - promoted: registry version {gate['promoted_version']} is now the `champion`")
    elif gate.get("passed") and gate.get("not_promoted"):
        lines.append(f"  - not promoted: the `champion` stays where it was ({gate['not_promoted']})")
    champion = gate.get("champion")
    if champion:
        lines.append(
            f"  - challenger {gate['variant']} {gate['accuracy']:.4f} against the champion (registry version "
            f"{champion['version']}, {champion['variant']}) {champion['accuracy']:.4f} on the same "
            f"{gate['images']} test files."
        )
    return lines


def weights_line(weights: dict[str, Any]) -> str:
    """Where a torchvision/timm network's training started: random, the library's pretrained file, or a user's."""
    source = str(weights.get("source", "none"))
    if source == "none":
        return "- Initial weights: none (randomly initialised, trained on this data only)."
    if source == "random":
        return (
            "- Initial weights: **random** — `model.weights: auto` found no pretrained weights "
            f"({weights.get('note', '')}); the network learnt from this data only. Supply the weights file "
            "(docs/own-model.md) for a far better model."
        )
    what = {
        "default": "the library's pretrained weights",
        "package": "the pretrained weights an installed package ships (pinned in uv.lock)",
    }.get(source, "a weights file")
    licence = str(weights.get("license") or "not stated")
    line = (
        f"- Initial weights: {what}, `{Path(str(weights.get('file', ''))).name}`, SHA-256 `{weights.get('sha256', '')}`"
        f" (licence: {licence}); classifier initialised fresh for these classes; input normalised with mean "
        f"{weights.get('mean')} / std {weights.get('std')}."
    )
    if weights.get("training"):  # train.from_pretrained: features says what it did and why
        line += f"\n- Training from them: {weights['training']}."
    return line


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion (sound near 0 and 1, unlike the normal approximation)."""
    if n <= 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def write(card: ModelCard, reports_dir: Path = REPORTS_DIR) -> Path:
    """Write the facts, then the Markdown rendered from them; returns the Markdown's path."""
    write_model(Path(reports_dir) / FACTS_PATH.name, card)
    return write_text_atomic(Path(reports_dir) / CARD_PATH.name, render(card))


def read(path: Path = FACTS_PATH) -> ModelCard:
    return read_model(path, ModelCard, RERUN, "model card")


def read_markdown_for(variant: str, reports_dir: Path = REPORTS_DIR, sha256: str = "") -> str | None:
    """The card's Markdown when there is a card and it describes `variant` (that file, when `sha256` is given);
    None otherwise (a card of another variant is worse than none)."""
    facts, card = Path(reports_dir) / FACTS_PATH.name, Path(reports_dir) / CARD_PATH.name
    if not (facts.is_file() and card.is_file()):
        return None
    shipped = read(facts).shipped
    if shipped.variant != variant or (sha256 and shipped.sha256 != sha256):
        return None
    return card.read_text()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f} %"


def render(card: ModelCard) -> str:
    """The card as Markdown: one section after another, each from its own facts."""
    sections = (_model_details, _intended_use, _limits, _training_data, _training_procedure, _evaluation, _speed)
    lines = [
        f"# Model card: {card.title or card.model_name}",
        "",
        "Generated by `pipeline card` from this pipeline's artifacts (reports/model_card.json holds the same facts).",
        "",
    ]
    for section in sections:
        lines += section(card)
    lines += ["## Known failure modes", "", *[f"- {m}" for m in card.failure_modes], ""]
    lines += [
        "## Reproduce",
        "",
        "`dvc repro` (or `make pipeline`) rebuilds every figure above; `dvc metrics show` lists them.",
        "",
    ]
    return "\n".join(lines)


def _model_details(card: ModelCard) -> list[str]:
    s = card.shipped
    return [
        "## Model details",
        "",
        f"- Task: image classification into {card.num_classes} classes ({card.data.dataset}).",
        f"- Network: `{card.architecture}`, {s.parameters:,} parameters, input {card.image_size}×{card.image_size} RGB"
        + (f": {card.image_size_reason}." if card.image_size_reason else "."),
        *([weights_line(card.initial_weights)] if card.initial_weights else []),
        *(
            [f"- Recipe: `{card.recipe_name}` (params.yaml's keys over it; `pipeline params` lists both)."]
            if card.recipe_name
            else []
        ),
        *gate_lines(card.gate),
        f"- Shipped variant: `{s.variant}` ({s.precision}, {s.format}, {s.size_bytes / 1e6:.2f} MB, "
        f"SHA-256 `{s.sha256[:12]}`), served with {s.backend}." + (f" {s.made_from}" if s.made_from else ""),
        "",
    ]


# How the server makes a whole image the model's square input, by data.resize.
SQUARING = {
    "stretch": "resizes the whole image",
    "center_crop": "takes the central square of the image and resizes it",
    "pad": "pads the image to a square on black bands and resizes it",
}


def _intended_use(card: ModelCard) -> list[str]:
    d = card.data
    crop = ", ".join(f"{100 * c:.1f} %" for c in d.crop)
    return [
        "## Intended use",
        "",
        (
            f"- Classify a photo of one {d.subject.one}. "
            if d.subject
            else f"- Classify an image into one of the {card.num_classes} classes of `{d.dataset}`, framed like its "
            "training images. "
        )
        + (
            f"Without a box the server cuts {crop} (left, top, right, bottom) and resizes; with a box "
            if any(d.crop)
            else f"Without a box the server {SQUARING.get(d.resize, 'resizes the whole image')}; with a box "
        )
        + "(`/v1/predict` `box=`) it crops the box plus a margin.",
        "- A component for recognition research, demos and as a template for your own classifier.",
        "",
    ]


def _limits(card: ModelCard) -> list[str]:
    d = card.data
    return [
        "## Out of scope and limits",
        "",
        f"- Not for safety-critical decisions: {100 * (1 - card.evaluation.accuracy):.2f} % of the test images are "
        "misclassified"
        + (
            f", and it has not been tested on {d.subject.untested}."
            if d.subject and d.subject.untested
            else ", and it has only been tested on the held-out images of its own data."
        ),
        f"- It has no reject option: every image, whatever it shows, gets one of the {card.num_classes} classes.",
        "- Images that show a scene rather than one object (detection) are outside what it was trained on.",
        "",
    ]


def _training_data(card: ModelCard) -> list[str]:
    d = card.data
    return [
        "## Training data",
        "",
        f"- {d.dataset}: {d.split_counts.get('train', 0):,} training, {d.split_counts.get('val', 0):,} validation, "
        f"{d.split_counts.get('test', 0):,} test images; {d.unreadable_files} unreadable files skipped.",
        f"- Validation: {d.validation}.",
        *(
            [
                f"- Train and validation images framed as `{d.framing}` "
                "(`served`: whole files less the served crop; `roi`: the annotated box plus a margin)."
            ]
            if d.boxes
            else []
        ),
        f"- Class balance: {min(d.train_per_class):,} to {max(d.train_per_class):,} training images per class.",
        f"- Prepared data checksum: `{d.content_sha256}`.",
        "",
    ]


def _training_procedure(card: ModelCard) -> list[str]:
    lines = ["## Training procedure", ""]
    for section, values in card.recipe.items():
        lines.append(f"- `{section}`: {', '.join(f'{k}={v}' for k, v in values.items())}")
    return [*lines, ""]


def _evaluation(card: ModelCard) -> list[str]:
    e, s = card.evaluation, card.shipped
    lo, hi = e.accuracy_ci95
    lines = [
        "## Evaluation",
        "",
        f"- **Served accuracy {_pct(e.accuracy)}** (95 % CI {_pct(lo)} to {_pct(hi)}) of {e.model} on "
        f"{e.images:,} test images ({e.measured_on}: the files as users send them, through the server's "
        f"preprocessing); {_count(e.errors, 'error')}, macro F1 {e.macro_f1:.4f}.",
    ]
    if card.data.boxes:
        lines.append(
            f"- ROI protocol (the annotated box plus margin, how papers report {card.data.dataset}): "
            f"{_pct(e.roi_accuracy)}."
        )
    if e.trained_accuracy is not None:
        roi = f", ROI {_pct(e.trained_roi_accuracy)}" if card.data.boxes else ""
        lines.append(
            f"- The trained model before optimisation (same inputs): {_pct(e.trained_accuracy)} served "
            f"({_count(e.trained_errors or 0, 'error')}){roi}; `{s.variant}` is "
            f"{abs(s.accuracy_drop_points):.2f} points {'below' if s.accuracy_drop_points >= 0 else 'above'} it on "
            "optimize's gate (the held-out files as served)."
        )
    lines += [
        "",
        "### Worst classes",
        "",
        "| class | accuracy | test images | training images | confused with (count: example files) |",
        "|---|---|---|---|---|",
    ]
    for c in e.worst:
        confusions = "; ".join(f"{x.predicted} ({x.count}: {', '.join(x.examples)})" for x in c.confused_with) or "-"
        lines.append(f"| {c.class_id} {c.name} | {_pct(c.accuracy)} | {c.support} | {c.train_images} | {confusions} |")
    lines += [
        "",
        "<details><summary>Accuracy per class</summary>",
        "",
        "| class | accuracy | test images | training images |",
        "|---|---|---|---|",
        *(f"| {c.class_id} {c.name} | {_pct(c.accuracy)} | {c.support} | {c.train_images} |" for c in e.per_class),
        "",
        "</details>",
        "",
    ]
    return lines


def _speedup(s: ShippedFacts) -> str:
    if not s.speedup_vs_default_eager:
        return ""
    if s.speedup_range and s.speedup_rounds:
        low, high = s.speedup_range
        return (
            f"; {s.speedup_vs_default_eager:.2f}× PyTorch's default eager fp32, the median of {s.speedup_rounds} "
            f"rounds timed alternately (range {low:.2f}-{high:.2f}×)"
        )
    return f"; {s.speedup_vs_default_eager:.2f}× PyTorch's default eager fp32 in one pair of measurements"


def _speed(card: ModelCard) -> list[str]:
    s = card.shipped
    speed = (
        f"{s.throughput_b32:,.0f} images/s at batch 32, p50 {s.p50_ms:.3f} ms / p99 {s.p99_ms:.3f} ms for one image"
        if s.throughput_b32 is not None and s.p50_ms is not None and s.p99_ms is not None
        else "not measured"
    )
    return [
        "## Optimisation and speed",
        "",
        f"- `{s.variant}` on {s.backend}: {speed}" + _speedup(s) + f" (measured on {s.machine}).",
        "",
    ]
