"""The setup the server runs, and the headline's rounds: the fastest all-core setup on a serving backend whose
answers agree with its variant's reference run; that setup and PyTorch's default eager timed alternately."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from pipeline.artifacts import benchmark_report
from pipeline.artifacts.benchmark_report import DEFAULT, ONEDNN_ON
from pipeline.benchmarking import worker
from pipeline.benchmarking.report import REPORT_DIR
from pipeline.benchmarking.setups import Result, Setup
from pipeline.config import BenchmarkConfig
from pipeline.console import Steps


def choose(results: Sequence[Result], config: BenchmarkConfig) -> Result | None:
    """Fastest setup at batch 32 (all cores) among the server's runtimes whose answers agree with its variant's
    reference run (the variant on its first runtime, default settings, all cores) on at least 1 - max_accuracy_drop
    of the test images: a backend must not change what its variant predicts. Label-free: optimize gated the variants
    themselves (on validation, or on agreement with the trained model), and no choice here reads the test labels."""
    references = reference_predictions(results)

    def agrees(r: Result) -> bool:
        reference = references.get(r.setup.variant)
        if r.predicted is None or reference is None:
            return False
        n = min(len(reference), len(r.predicted))  # a reference the server cannot run scored the first images only
        same = sum(a == b for a, b in zip(r.predicted[:n], reference[:n], strict=True))
        return n > 0 and same >= (1 - config.max_accuracy_drop) * n - 1e-9

    candidates = [
        r for r in results
        if r.status == "ok" and r.setup.threads == 0 and r.setup.backend in config.serving_backends and agrees(r)
    ]  # fmt: skip
    key = f"throughput_b{config.batch_sizes[0]}"
    return max(candidates, key=lambda r: r.metrics[key], default=None)


def reference_predictions(results: Sequence[Result]) -> dict[str, list[int]]:
    """Each variant's answers on its first measured setup at default settings and all cores (plan() measures a
    variant's own runtime first)."""
    references: dict[str, list[int]] = {}
    for r in results:
        default = r.setup.setting in (DEFAULT, ONEDNN_ON) and r.setup.threads == 0
        if r.status == "ok" and default and r.predicted is not None and r.setup.variant not in references:
            references[r.setup.variant] = r.predicted
    return references


def no_servable_setup(variants: Sequence[Any], config: BenchmarkConfig) -> str:
    """Why nothing can be served: no shipped variant runs on the server's backends (each rejected one with
    optimize's reason), or some did but every setup of them lost accuracy here."""
    backends = ", ".join(config.serving_backends)
    runnable = [v for v in variants if set(v.runtimes) & set(config.serving_backends)]
    if not any(v.accepted for v in runnable):
        rejected = "; ".join(f"{v.name}: {v.reason}" for v in runnable if not v.accepted) or "none was made"
        others = sorted({v.name for v in variants if v.accepted} - {v.name for v in runnable})
        return (
            f"optimize shipped no variant that runs on {backends} (benchmark.serving_backends): {rejected}. "
            + (f"Shipped, on other backends: {', '.join(others)}; " if others else "")
            + "see reports/optimize/variants.md; relax the optimize gates, or serve another backend"
        )
    return (
        f"no setup among {backends} passed the accuracy gate (each within {config.max_accuracy_drop} of its "
        f"variant's accuracy in models/manifest.json); see {REPORT_DIR / 'table.md'}"
    )


def headline_rounds(chosen: Result | None, results: Sequence[Result], config: BenchmarkConfig) -> dict[str, Any] | None:
    """The served setup and PyTorch's default eager timed alternately, `benchmark.headline_rounds` times, each run in
    a fresh process: the ratio of each round, their median and range (None without the two, or with 0 rounds)."""
    key = f"throughput_b{config.batch_sizes[0]}"
    default = benchmark_report.default_eager([r.record() for r in results], config.batch_sizes[0])
    if chosen is None or default is None or config.headline_rounds == 0:
        return None
    baseline = Setup(**default["setup"])
    served, eager = [], []
    steps = Steps("benchmark headline", config.headline_rounds)
    for i in range(config.headline_rounds):
        with steps.running(f"round {i + 1}: {chosen.setup.label} and {baseline.label}"):
            pair = [
                worker.run_setup(s, config, config.timeout_s, throughput_only=True) for s in (chosen.setup, baseline)
            ]
        if any(r.status != "ok" for r in pair):
            return None
        served.append(pair[0].metrics[key])
        eager.append(pair[1].metrics[key])
        steps.finished(f"round {i + 1}", f"{served[-1] / eager[-1]:.2f}x")
    ratios = sorted(s / e for s, e in zip(served, eager, strict=True))
    return {
        "served": chosen.setup.label,
        "baseline": baseline.label,
        "batch": config.batch_sizes[0],
        "rounds": len(ratios),
        "ratios": [s / e for s, e in zip(served, eager, strict=True)],
        "median": statistics.median(ratios),
        "low": ratios[0],
        "high": ratios[-1],
        "served_img_s_median": statistics.median(served),
        "baseline_img_s_median": statistics.median(eager),
    }
