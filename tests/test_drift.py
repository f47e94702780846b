"""The drift signals (pipeline/drift.py): buckets, the Prometheus exposition both ways, the comparison."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pipeline import drift

CLASSES = [f"c{i}" for i in range(43)]


def _traffic(counts: drift.SignalCounts, rng: np.random.Generator, n: int, dark: float = 1.0) -> None:
    logits = rng.normal(size=(n, len(counts.classes))) * 4
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    counts.add_outputs(probabilities)
    counts.add_images(rng.random((n, 3, 16, 16), dtype=np.float32) * dark)
    counts.add_sizes([(int(w), int(h)) for w, h in rng.integers(25, 120, size=(n, 2))])


def test_a_value_on_an_edge_counts_in_that_bucket_and_above_the_last_in_the_overflow() -> None:
    counts = drift.SignalCounts(["a", "b"])
    counts.add_sizes([(32, 32), (33, 5000)])
    widths = counts.buckets["width"]
    edges = drift.SIGNALS["width"].edges
    assert widths[edges.index(32)] == 1 and widths[edges.index(48)] == 1  # 32 <= 32; 32 < 33 <= 48
    assert counts.buckets["height"][-1] == 1  # 5000 > 4096
    assert counts.sums["width"] == 65


def test_the_exposition_reads_back_to_the_same_counts_for_one_worker_and_for_several() -> None:
    rng = np.random.default_rng(0)
    single = drift.SignalCounts(list(CLASSES))
    registry = CollectorRegistry()
    registry.register(drift.Collector(single, "abc"))
    several_registry = CollectorRegistry()
    several = drift.PrometheusSignals(CLASSES, "abc", several_registry)
    for target in (single, several):
        _traffic(target, np.random.default_rng(1), 300)
    del rng
    read_single = drift.parse_metrics(generate_latest(registry).decode(), CLASSES)
    read_several = drift.parse_metrics(generate_latest(several_registry).decode(), CLASSES)
    assert read_single.buckets == single.buckets == read_several.buckets
    assert read_single.class_counts == single.class_counts == read_several.class_counts
    assert sum(single.class_counts) == 300
    assert read_single.sums["width"] == pytest.approx(single.sums["width"])


def test_the_series_stay_fixed_whatever_the_inputs() -> None:
    """No label takes a value from a request: fuzzed sizes, brightness and outputs add no series."""
    counts = drift.SignalCounts(list(CLASSES))
    registry = CollectorRegistry()
    registry.register(drift.Collector(counts, "abc"))
    series = lambda: {line.split(" ")[0] for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")}  # noqa: E731
    before = series()
    rng = np.random.default_rng(2)
    for _ in range(50):
        n = int(rng.integers(1, 9))
        _traffic(counts, rng, n, dark=float(rng.random()))
        counts.add_sizes([(int(rng.integers(1, 100000)), int(rng.integers(1, 100000)))])
    assert series() == before


def test_a_sample_of_the_reference_passes_and_a_darker_one_drifts_on_brightness() -> None:
    reference = drift.SignalCounts(list(CLASSES))
    _traffic(reference, np.random.default_rng(3), 2000)
    same = drift.SignalCounts(list(CLASSES))
    _traffic(same, np.random.default_rng(4), 200)  # 200 images over 43 classes: a large PSI by chance alone
    result = {s.signal: s for s in drift.compare(reference, same, 0.2, 0.01)}
    assert not any(s.drifted for s in result.values()), result
    assert result["class"].psi > 0.2  # why PSI alone would not do
    dark = drift.SignalCounts(list(CLASSES))
    _traffic(dark, np.random.default_rng(5), 200, dark=0.4)
    drifted = [s.signal for s in drift.compare(reference, dark, 0.2, 0.01) if s.drifted]
    assert drifted == ["brightness"]


def test_a_reference_with_other_buckets_is_refused() -> None:
    counts = drift.SignalCounts(["a"])
    reference = drift.to_reference(counts, "fp32-onnx", "abc", "test")
    assert drift.from_reference(reference).buckets == counts.buckets
    changed = reference.model_copy(
        update={"signals": {**reference.signals, "width": reference.signals["height"].model_copy(update={"edges": [1.0], "counts": [0, 0]})}}
    )
    with pytest.raises(ValueError, match="width buckets"):
        drift.from_reference(changed)
