"""reports/benchmark/report.json: every benchmark setup of one machine (facts, results, the choice), written by the
benchmark stage and read by `pipeline compare` (the workflows' x86-vs-Arm table)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_text_atomic
from pipeline.artifacts.variants import TRAINED
from pipeline.runtimes import baseline_backend

REPORT_PATH = REPORTS_DIR / "benchmark" / "report.json"


class BenchmarkReport(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    machine: dict[str, Any]
    """CPU, ISA flags, cores, library versions and the torch build's BLAS / oneDNN / ACL (pipeline.machine)."""
    results: list[dict[str, Any]]
    """One entry per setup: {setup: {variant, backend, setting, threads}, status, error, metrics}."""
    chosen: dict[str, Any] | None = None


# A setup's `setting`: the switches its worker process starts with (oneDNN ones only where the backend's record has
# onednn_settings and the torch build has oneDNN).
DEFAULT = "default"
ONEDNN_OFF = "onednn-off"
ONEDNN_ON = "onednn-on"
BF16_FPMATH = "bf16-fpmath"  # oneDNN on, its fp32 math in bf16 (CPUs with native bf16)

# PyTorch's default: fp32 eager, oneDNN on, all threads. What users would otherwise run; the speed-ups that the
# card and the MLflow parent run quote are against it. The eager backend is the table's baseline (pipeline.runtimes).
DEFAULT_EAGER = (TRAINED, baseline_backend(), ONEDNN_ON)  # what users run without us: PyTorch's defaults
ONEDNN_OFF_EAGER = (TRAINED, baseline_backend(), ONEDNN_OFF)  # the learning path's "OpenBLAS" row: ATen + BLAS


def best_eager(
    results: Sequence[dict[str, Any]], setup: tuple[str, str, str] = DEFAULT_EAGER, batch: int = 32
) -> dict[str, Any] | None:
    """The fastest successful result of `setup` (variant, backend, setting) at batch `batch` over the thread counts
    measured (1 and all): a baseline that oversubscribed threads slow down never flatters the served setup."""
    key = f"throughput_b{batch}"
    found = [
        r for r in results
        if r.get("status") == "ok" and (r["setup"]["variant"], r["setup"]["backend"], r["setup"]["setting"]) == setup
        and key in r.get("metrics", {})
    ]  # fmt: skip
    return max(found, key=lambda r: r["metrics"][key], default=None)


def default_eager(results: Sequence[dict[str, Any]], batch: int = 32) -> dict[str, Any] | None:
    """PyTorch's default eager fp32 (oneDNN on), the better of 1 and all threads."""
    return best_eager(results, DEFAULT_EAGER, batch)


def write(report: dict[str, Any], path: Path = REPORT_PATH) -> Path:
    BenchmarkReport.model_validate(report)  # the reader's contract holds for what is written
    return write_text_atomic(path, json.dumps(report, indent=2) + "\n")


def read(path: Path = REPORT_PATH) -> BenchmarkReport:
    return read_model(path, BenchmarkReport, "not a benchmark report (reports/benchmark/report.json)", "report")
