"""What one measurement is, and which ones this machine runs: every accepted variant on each backend it lists (in
benchmark.backends), at each setting its backend's record asks for, at each thread count."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.artifacts.benchmark_report import BF16_FPMATH, DEFAULT, ONEDNN_OFF, ONEDNN_ON
from pipeline.config import BenchmarkConfig
from pipeline.runtimes import RUNTIME_BACKENDS


@dataclass(frozen=True)
class Setup:
    variant: str
    backend: str
    setting: str  # "default", "onednn-off", "onednn-on", "bf16-fpmath"
    threads: int  # 0 = all cores

    @property
    def label(self) -> str:
        threads = "all cores" if self.threads == 0 else f"{self.threads} thread"
        return f"{self.variant} / {self.backend} / {self.setting} / {threads}"


@dataclass
class Result:
    setup: Setup
    status: str  # ok | failed | skipped
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    predicted: list[int] | None = None
    """Top-1 class of every test image (the choice's label-free guard; not written to the report)."""

    def record(self) -> dict[str, Any]:
        """What report.json keeps of it."""
        return {k: v for k, v in asdict(self).items() if k != "predicted"}


def bf16_capable(isa: Sequence[str], architecture: str | None = None) -> bool:
    from pipeline.machine import has_native_bf16

    return has_native_bf16(set(isa), architecture)


def plan(manifest: Any, facts: dict[str, Any], config: BenchmarkConfig) -> tuple[list[Setup], list[Result]]:
    """Which setups to run on this machine, and which are skipped (with the reason)."""
    setups: list[Setup] = []
    skipped: list[Result] = []
    thread_counts = sorted(set(config.threads))
    for variant in manifest.variants:
        if not variant.accepted:
            continue
        for backend in variant.runtimes:
            if config.backends and backend not in config.backends:
                continue
            reason = untimed_because(variant, backend, facts)
            if reason:
                skipped.append(Result(Setup(variant.name, backend, DEFAULT, 0), "skipped", reason))
                continue
            for setting in settings(variant.name, backend, facts, skipped):
                setups += [Setup(variant.name, backend, setting, threads) for threads in thread_counts]
    return setups, skipped


def untimed_because(variant: Any, backend: str, facts: dict[str, Any]) -> str | None:
    """Why `variant` is not timed on `backend` here (its record's untimed formats, a CUDA device it lacks), or None.
    A backend the table does not know is timed: its worker fails, and the report says why."""
    record = RUNTIME_BACKENDS.get(backend)
    if record is None:
        return None
    reason = record.untimed.get(getattr(variant, "format", ""))
    if reason:
        return reason
    return "no CUDA device" if record.cuda and not facts.get("cuda") else None


def settings(variant: str, backend: str, facts: dict[str, Any], skipped: list[Result]) -> list[str]:
    """The settings `backend` is timed at: oneDNN off and on (and bf16 fast math where the CPU has native bf16; else
    a skipped result in `skipped`) for a backend whose record asks, where the torch build has oneDNN; else default."""
    record = RUNTIME_BACKENDS.get(backend)
    if record is None or not record.onednn_settings or not facts.get("onednn_available"):
        return [DEFAULT]
    if bf16_capable(facts.get("isa", []), facts.get("architecture")):
        return [ONEDNN_OFF, ONEDNN_ON, BF16_FPMATH]
    skipped.append(Result(Setup(variant, backend, BF16_FPMATH, 0), "skipped", "CPU has no native bf16"))
    return [ONEDNN_OFF, ONEDNN_ON]
