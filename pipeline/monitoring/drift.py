"""Drift signals: what the server sees and what it answers, counted in fixed buckets.

One definition used three ways, so the figures compare like with like:
  - the server counts every answered image (`SignalCounts.add_*`) and exposes the counts as Prometheus histograms
    (`Collector`; names below), one series per bucket: no label takes a value a user chose;
  - evaluate counts the original test files through the same decode path and writes the reference
    (pipeline/artifacts/drift_reference.py), which goes into the image with the model;
  - `pipeline monitor --drift` reads live counts back from /metrics (or a Prometheus server) and compares them
    with the reference (`compare`): a chi-square test of homogeneity (scipy) for significance and the population
    stability index (PSI) for size; a signal drifts when both pass their thresholds.

numpy only here (scipy lazily, in `compare`): the server image imports it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Signal:
    metric: str
    help: str
    edges: tuple[float, ...]
    """Upper bounds of the buckets (Prometheus `le`); one more bucket holds everything above the last."""


SIGNALS: dict[str, Signal] = {
    "confidence": Signal(
        "inference_confidence",
        "Top-1 probability of each answered image",
        (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.999),
    ),
    "brightness": Signal(
        "inference_input_brightness",
        "Mean pixel value (0-1) of each image as the model sees it (after framing, before normalization)",
        tuple(round(0.05 * i, 2) for i in range(1, 20)),
    ),
    "width": Signal(
        "inference_input_width_pixels",
        "Width of each image file as sent",
        (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096),
    ),
    "height": Signal(
        "inference_input_height_pixels",
        "Height of each image file as sent",
        (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096),
    ),
    "aspect": Signal(
        "inference_input_aspect_ratio",
        "Width / height of each image file as sent",
        (0.5, 0.67, 0.8, 0.9, 0.95, 1.05, 1.11, 1.25, 1.5, 2.0),
    ),
}
CLASS_METRIC = "inference_predictions"
CLASS_SIGNAL = "class"
BRIGHTNESS_SAMPLES = 4096  # values averaged per image: a fixed cost at any image size


@dataclass
class SignalCounts:
    """Per-bucket counts (not cumulative) and sums of every signal, and answers per class."""

    classes: list[str]
    buckets: dict[str, list[int]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)
    class_counts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, signal in SIGNALS.items():
            self.buckets.setdefault(name, [0] * (len(signal.edges) + 1))
            self.sums.setdefault(name, 0.0)
        if not self.class_counts:
            self.class_counts = [0] * len(self.classes)

    def _add(self, name: str, values: Iterable[float]) -> None:
        counts, edges, total = self.buckets[name], SIGNALS[name].edges, 0.0
        for value in values:
            counts[bisect.bisect_left(edges, value)] += 1  # le semantics: value <= edge goes in that bucket
            total += value
        self.sums[name] += total

    def add_outputs(self, probabilities: np.ndarray) -> None:
        """Top-1 class and confidence of each row of [N, C] probabilities."""
        top = probabilities.argmax(axis=1)
        self._add("confidence", probabilities[np.arange(len(top)), top].tolist())
        self._add_classes(top.tolist())

    def _add_classes(self, top: list[int]) -> None:
        for c in top:
            self.class_counts[c] += 1

    def add_images(self, images: np.ndarray) -> None:
        """Brightness of float [N, 3, S, S] images in [0, 1] (as decode_images returns them)."""
        self._add("brightness", brightness(images).tolist())

    def add_sizes(self, sizes: Iterable[tuple[int, int]]) -> None:
        """(width, height) of each image file."""
        sizes = list(sizes)
        self._add("width", (w for w, _ in sizes))
        self._add("height", (h for _, h in sizes))
        self._add("aspect", (w / max(1, h) for w, h in sizes))

    def totals(self) -> dict[str, int]:
        return {name: sum(counts) for name, counts in self.buckets.items()} | {CLASS_SIGNAL: sum(self.class_counts)}

    def minus(self, earlier: SignalCounts) -> SignalCounts:
        """What was counted since `earlier` (two scrapes of the same server)."""
        return SignalCounts(
            self.classes,
            {n: [a - b for a, b in zip(c, earlier.buckets[n], strict=True)] for n, c in self.buckets.items()},
            {n: s - earlier.sums[n] for n, s in self.sums.items()},
            [a - b for a, b in zip(self.class_counts, earlier.class_counts, strict=True)],
        )


class PrometheusSignals(SignalCounts):
    """The same counts through prometheus_client's own Histogram and Counter (about 2 µs a value, against a bisect
    here), for a server of several workers: prometheus_client sums those over the workers' files, which it cannot
    do for a custom collector. Same metric names and buckets as `Collector`."""

    def __init__(self, classes: list[str], version: str, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        super().__init__(list(classes))
        self._histograms = {
            name: Histogram(s.metric, s.help, ["model_version"], buckets=s.edges, registry=registry).labels(version)
            for name, s in SIGNALS.items()
        }
        counter = Counter(CLASS_METRIC, "Answered images by top-1 class", ["model_version", "class"], registry=registry)
        self._classes = [counter.labels(version, c) for c in classes]

    def _add(self, name: str, values: Iterable[float]) -> None:
        histogram = self._histograms[name]
        for value in values:
            histogram.observe(value)

    def _add_classes(self, top: list[int]) -> None:
        for c in top:
            self._classes[c].inc()


def brightness(images: np.ndarray) -> np.ndarray:
    """Mean value of each [C, H, W] image, from every k-th row (about BRIGHTNESS_SAMPLES values, whole rows so
    the reads stay contiguous): 2 µs at 32 px and 3 µs at 224 px where `mean` over every value took 8 and 33."""
    _, channels, height, width = images.shape
    step = max(1, (channels * height * width) // BRIGHTNESS_SAMPLES)
    sampled = images[:, :, ::step, :]
    return np.add.reduce(sampled, axis=(1, 2, 3), dtype=np.float64) / (channels * sampled.shape[2] * width)


def _histogram(
    metric: str, help_text: str, labels: dict[str, str], edges: Sequence[float], counts: list[int], total: float
) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    family = HistogramMetricFamily(metric, help_text, labels=list(labels))
    cumulative, running = [], 0
    for edge, count in zip([*map(_le, edges), "+Inf"], counts, strict=True):
        running += count
        cumulative.append((edge, running))
    family.add_metric(list(labels.values()), cumulative, total)
    return family


def _le(edge: float) -> str:
    return repr(float(edge))


class Collector:
    """The counts as Prometheus metrics at scrape time (prometheus_client's custom-collector protocol): the hot
    path is a bisect and an increment per value, about 1 µs per image, where a Histogram.observe per signal costs
    about 2 µs each (`python -m benchmarks drift`)."""

    def __init__(self, counts: SignalCounts, version: str) -> None:
        self.counts = counts
        self.labels = {"model_version": version}

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        for name, signal in SIGNALS.items():
            yield _histogram(
                signal.metric, signal.help, self.labels, signal.edges, self.counts.buckets[name], self.counts.sums[name]
            )
        answers = CounterMetricFamily(CLASS_METRIC, "Answered images by top-1 class", labels=[*self.labels, "class"])
        for name, count in zip(self.counts.classes, self.counts.class_counts, strict=True):
            answers.add_metric([*self.labels.values(), name], count)
        yield answers


def parse_metrics(text: str, classes: list[str]) -> SignalCounts:
    """SignalCounts from the Prometheus text exposition of a server (summed over model versions and workers)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = SignalCounts(list(classes))
    by_metric = {signal.metric: name for name, signal in SIGNALS.items()}
    index = {c: i for i, c in enumerate(classes)}
    cumulative: dict[str, dict[float, float]] = {name: {} for name in SIGNALS}
    for family in text_string_to_metric_families(text):
        if family.name in by_metric:
            name = by_metric[family.name]
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    le = math.inf if sample.labels["le"] == "+Inf" else float(sample.labels["le"])
                    cumulative[name][le] = cumulative[name].get(le, 0.0) + sample.value
                elif sample.name.endswith("_sum"):
                    counts.sums[name] += sample.value
        elif family.name == CLASS_METRIC:
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("class") in index:
                    counts.class_counts[index[sample.labels["class"]]] += int(sample.value)
    for name, by_le in cumulative.items():
        if by_le:
            counts.buckets[name] = from_cumulative(SIGNALS[name].edges, by_le)
    return counts


def from_cumulative(edges: Sequence[float], by_le: dict[float, float]) -> list[int]:
    """Per-bucket counts from Prometheus' cumulative `le` counts (a bucket the server does not have reads 0)."""
    running, out = 0.0, []
    for edge in [*map(float, edges), math.inf]:
        value = by_le.get(edge, running)
        out.append(round(value - running))
        running = value
    return out


@dataclass(frozen=True)
class SignalDrift:
    signal: str
    reference_images: int
    live_images: int
    psi: float
    p_value: float
    drifted: bool
    reference_mean: float | None = None
    live_mean: float | None = None


def psi(reference: Sequence[float], live: Sequence[float], floor: float = 1e-4) -> float:
    """Population stability index of two count vectors over the same buckets."""
    ref = np.asarray(reference, dtype=np.float64)
    cur = np.asarray(live, dtype=np.float64)
    p = np.maximum(ref / max(ref.sum(), 1.0), floor)
    q = np.maximum(cur / max(cur.sum(), 1.0), floor)
    return float(np.sum((q - p) * np.log(q / p)))


def homogeneity_p_value(reference: Sequence[float], live: Sequence[float]) -> float:
    """p-value of a chi-square test that both count vectors come from one distribution (buckets empty in both
    dropped); 1.0 when fewer than two buckets hold anything."""
    from scipy.stats import chi2_contingency

    table = np.asarray([reference, live], dtype=np.float64)
    table = table[:, table.sum(axis=0) > 0]
    if table.shape[1] < 2 or (table.sum(axis=1) == 0).any():
        return 1.0
    return float(chi2_contingency(table, correction=False).pvalue)


def compare(reference: SignalCounts, live: SignalCounts, max_psi: float, max_p_value: float) -> list[SignalDrift]:
    """Every signal the live counts hold images for: drifted when its PSI exceeds `max_psi` AND the chi-square
    p-value is below `max_p_value` (a large shift that is not sampling noise: a few hundred images over 43 classes
    give a PSI near 0.3 by chance alone, while a p-value alone flags negligible shifts of large samples)."""
    out = []
    pairs = [(name, reference.buckets[name], live.buckets[name]) for name in SIGNALS]
    pairs.append((CLASS_SIGNAL, reference.class_counts, live.class_counts))
    for name, ref, cur in pairs:
        if sum(cur) == 0 or sum(ref) == 0:
            continue
        index, p = psi(ref, cur), homogeneity_p_value(ref, cur)
        means = (reference.sums[name] / sum(ref), live.sums[name] / sum(cur)) if name in SIGNALS else (None, None)
        out.append(
            SignalDrift(
                name, int(sum(ref)), int(sum(cur)), round(index, 4), p, index > max_psi and p < max_p_value, *means
            )
        )
    return out


def to_reference(counts: SignalCounts, variant: str, version: str, source: str) -> Any:
    from pipeline.artifacts.drift_reference import DriftReference, SignalReference

    return DriftReference(
        variant=variant,
        model_version=version,
        source=source,
        classes=list(counts.classes),
        class_counts=list(counts.class_counts),
        signals={
            name: SignalReference(edges=list(signal.edges), counts=counts.buckets[name], sum=counts.sums[name])
            for name, signal in SIGNALS.items()
        },
    )


def from_reference(reference: Any) -> SignalCounts:
    """A DriftReference as SignalCounts; a ValueError when it was written with other buckets than these."""
    counts = SignalCounts(list(reference.classes), class_counts=list(reference.class_counts))
    for name, signal in SIGNALS.items():
        ref = reference.signals.get(name)
        if ref is None or [float(e) for e in ref.edges] != [float(e) for e in signal.edges]:
            raise ValueError(f"the reference's {name} buckets are not this version's: rerun `pipeline evaluate`")
        counts.buckets[name], counts.sums[name] = list(ref.counts), ref.sum
    return counts
