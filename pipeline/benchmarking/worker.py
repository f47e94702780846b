"""One setup measured in a fresh interpreter, so thread, oneDNN and fast-math switches apply before any library is
imported: `python -m pipeline.benchmarking.worker SETUP_JSON CONFIG_JSON [--throughput-only]` prints one JSON line.
The stage's side (run_setup, time_all) turns a crash, hang or error into a failed result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts.benchmark_report import BF16_FPMATH, ONEDNN_OFF
from pipeline.artifacts.prepared import ModelInput
from pipeline.benchmarking.setups import Result, Setup
from pipeline.config import BenchmarkConfig
from pipeline.console import Steps
from pipeline.runtimes import RUNTIME_BACKENDS

WORKER = "pipeline.benchmarking.worker"  # this module, as `python -m` runs it
UNSERVED_AGREEMENT_IMAGES = 128  # test images a setup the server cannot run is scored and compared on


def _worker_env(setup: Setup) -> dict[str, str]:
    env = dict(os.environ)
    if setup.threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(setup.threads)
    if setup.setting == BF16_FPMATH:
        env["DNNL_DEFAULT_FPMATH_MODE"] = "BF16"
    return env


def run_setup(setup: Setup, config: BenchmarkConfig, timeout_s: float, throughput_only: bool = False) -> Result:
    """Measure one setup in a fresh interpreter; a crash, hang or error becomes a failed result."""
    command = [sys.executable, "-m", WORKER, json.dumps(asdict(setup)), config.model_dump_json()]
    command += ["--throughput-only"] if throughput_only else []
    try:
        done = subprocess.run(
            command, env=_worker_env(setup), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return Result(setup, "failed", f"timed out after {timeout_s:.0f} s")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return Result(setup, "failed", f"exit {done.returncode}: {tail[:300]}")
    measured = json.loads(lines[-1])
    return Result(setup, "ok", metrics=measured, predicted=measured.pop("predicted", None))


def time_all(setups: Sequence[Setup], config: BenchmarkConfig) -> list[Result]:
    """Every setup, one after another, each in its own process, with a line of progress each."""
    results = []
    steps = Steps("benchmark", len(setups))
    for setup in setups:
        with steps.running(setup.label):
            result = run_setup(setup, config, config.timeout_s)
        results.append(result)
        summary = (
            f"{result.metrics['throughput_b' + str(config.batch_sizes[0])]:,.0f} img/s, "
            f"p50 {result.metrics['p50_ms']:.3f} ms, acc {result.metrics['accuracy']:.4f}"
            if result.status == "ok" else f"{result.status}: {result.error}"
        )  # fmt: skip
        steps.finished(setup.label, summary)
    return results


# ---- the worker: runs in its own process -----------------------------------------------------------------


def _percentiles(seconds: list[float]) -> dict[str, float]:
    import numpy as np

    ms = np.array(seconds) * 1000.0
    return {f"p{q}_ms": float(np.percentile(ms, q)) for q in (50, 90, 99)}


def _throughput(predict: Any, batch: Any, min_seconds: float, min_calls: int) -> float:
    predict(batch)  # warm-up at this shape
    calls = 0
    started = time.perf_counter()
    while calls < min_calls or time.perf_counter() - started < min_seconds:
        predict(batch)
        calls += 1
    return calls * len(batch) / (time.perf_counter() - started)


def _batch_of(images: Any, size: int) -> Any:
    import numpy as np

    return np.resize(images, (size, *images.shape[1:])) if size > len(images) else images[:size]


def _latencies(predict: Any, images: Any, config: BenchmarkConfig) -> list[float]:
    """Seconds per single-image call: warm-up, then at least latency_calls calls and min_seconds (20x the calls
    at most)."""
    for i in range(config.warmup):
        predict(images[i % len(images)][None])
    latencies = []
    deadline = time.perf_counter() + config.min_seconds
    i = 0
    while i < config.latency_calls or time.perf_counter() < deadline:
        one = images[i % len(images)][None]
        t = time.perf_counter()
        predict(one)
        latencies.append(time.perf_counter() - t)
        i += 1
        if i >= 20 * config.latency_calls:
            break
    return latencies


def _predictions(predict: Any, test: ModelInput, chunk: int, served: bool) -> Any:
    """Top-1 class of the whole test split (a backend the server runs), else of its first images: a slow eager setup
    took minutes on a whole split."""
    import numpy as np

    if served:
        return np.concatenate([predict(batch).argmax(axis=1) for batch in test.batches(chunk)])
    sample = test.head(UNSERVED_AGREEMENT_IMAGES)
    return np.concatenate([predict(sample[i : i + chunk]).argmax(axis=1) for i in range(0, len(sample), chunk)])


def _switch_torch(setup: Setup) -> None:
    """A backend on PyTorch (its record needs torch): its threads, and oneDNN off for the onednn-off setting."""
    record = RUNTIME_BACKENDS.get(setup.backend)
    if record is None or not record.torch:
        return
    import torch

    if setup.threads:
        torch.set_num_threads(setup.threads)
    if setup.setting == ONEDNN_OFF:
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]


def measure(setup: Setup, config: BenchmarkConfig, throughput_only: bool = False) -> dict[str, Any]:
    _switch_torch(setup)
    from pipeline.runtimes import open_runtime

    test = ModelInput.of_split("test")
    # The timing loops cycle through a sample in memory; the accuracy below reads the split a batch at a time.
    images, labels = test.head(max(256, *config.batch_sizes)), test.labels

    started = time.perf_counter()
    runtime = open_runtime(MODELS_DIR, setup.variant, backend=setup.backend, threads=setup.threads or None)
    runtime.predict(images[:1])
    startup_s = time.perf_counter() - started

    if throughput_only:  # a headline round: the first batch size only
        size = config.batch_sizes[0]
        return {f"throughput_b{size}": _throughput(runtime.predict, _batch_of(images, size), config.min_seconds, 3)}
    metrics: dict[str, float] = {"startup_s": startup_s, **_percentiles(_latencies(runtime.predict, images, config))}
    for size in config.batch_sizes:
        metrics[f"throughput_b{size}"] = _throughput(runtime.predict, _batch_of(images, size), config.min_seconds, 3)

    chunk = config.batch_sizes[0]  # the timed batch size: a fixed 256 held gigabytes at 224 px
    predicted = _predictions(runtime.predict, test, chunk, setup.backend in config.serving_backends)
    metrics["accuracy"] = float(
        (predicted == labels[: len(predicted)]).mean()
    )  # reported; the choice reads `predicted`
    from pipeline.machine import own_peak_rss_mib

    metrics["peak_memory_mb"] = own_peak_rss_mib()
    return {**metrics, "predicted": predicted.tolist()}


if __name__ == "__main__":  # python -m pipeline.benchmarking.worker SETUP_JSON CONFIG_JSON [--throughput-only]
    worker_setup = Setup(**json.loads(sys.argv[1]))
    worker_config = BenchmarkConfig.model_validate_json(sys.argv[2])
    print(json.dumps(measure(worker_setup, worker_config, "--throughput-only" in sys.argv[3:])), flush=True)
