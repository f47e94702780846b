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

REPORT_PATH = REPORTS_DIR / "benchmark" / "report.json"


class BenchmarkReport(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    machine: dict[str, Any]
    """CPU, ISA flags, cores, library versions and the torch build's BLAS / oneDNN / ACL (pipeline.machine)."""
    results: list[dict[str, Any]]
    """One entry per setup: {setup: {variant, backend, setting, threads}, status, error, metrics}."""
    chosen: dict[str, Any] | None = None


# PyTorch's default: fp32 eager, oneDNN on, all threads. What users would otherwise run; the speed-ups that the
# card and the MLflow parent run quote are against it.
DEFAULT_EAGER = ("fp32", "torch-eager", "onednn-on", 0)


def default_eager(results: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The successful DEFAULT_EAGER result among a report's results, if it was measured."""
    for r in results:
        s = r["setup"]
        if r.get("status") == "ok" and (s["variant"], s["backend"], s["setting"], s["threads"]) == DEFAULT_EAGER:
            return r
    return None


def write(report: dict[str, Any], path: Path = REPORT_PATH) -> Path:
    BenchmarkReport.model_validate(report)  # the reader's contract holds for what is written
    return write_text_atomic(path, json.dumps(report, indent=2) + "\n")


def read(path: Path = REPORT_PATH) -> BenchmarkReport:
    return read_model(path, BenchmarkReport, "not a benchmark report (reports/benchmark/report.json)", "report")
