"""What the server's drift signals cost per request, measured side by side in one run.

    uv run python -m benchmarks drift [--repeats 7] [--calls 20000]

Times exactly what the server runs per answered request (pipeline/serve/inference.py `run_model`: add_outputs,
add_images, add_sizes) on realistic inputs — 1 and 8 images a request, 32 and 224 px, 43 classes — for the
one-worker path (`SignalCounts` + a custom collector) and the several-workers path (`PrometheusSignals`:
prometheus_client's multiprocess metrics, in a temporary PROMETHEUS_MULTIPROC_DIR), and one scrape of /metrics'
drift part. Microseconds per request, best of `--repeats` rounds, the setups interleaved within each round so a
noisy neighbour hits them alike; the server is single-threaded per worker, so this is CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.monitoring import drift

CLASSES = [f"class {i}" for i in range(43)]


def per_call_us(run: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e6


def request(images: int, size: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(images, len(CLASSES))).astype(np.float32) * 4
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    pixels = rng.random((images, 3, size, size), dtype=np.float32)
    return probabilities, pixels, [(int(w), int(h)) for w, h in rng.integers(25, 250, size=(images, 2))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        # prometheus_client picks its file-backed values at import when this is set, as in a server's workers
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
        try:
            from prometheus_client import CollectorRegistry, generate_latest, values

            multiprocess = values.ValueClass.__name__ != "MutexValue"
            single = drift.SignalCounts(list(CLASSES))
            registry = CollectorRegistry()
            registry.register(drift.Collector(single, "abc"))
            several = drift.PrometheusSignals(CLASSES, "abc", CollectorRegistry())
            rows: list[dict[str, Any]] = []
            for images, size in ((1, 32), (8, 32), (1, 224), (8, 224)):
                probabilities, pixels, sizes = request(images, size)

                def record(
                    counts: drift.SignalCounts,
                    probabilities: np.ndarray = probabilities,
                    pixels: np.ndarray = pixels,
                    sizes: list[tuple[int, int]] = sizes,
                ) -> Callable[[], None]:
                    def run() -> None:  # what run_model adds per answered request
                        counts.add_outputs(probabilities)
                        counts.add_images(pixels)
                        counts.add_sizes(sizes)

                    return run

                several_name = "several workers" + ("" if multiprocess else " (in-memory values: imported earlier)")
                setups = {"one worker (custom collector)": record(single), several_name: record(several)}
                best = {name: float("inf") for name in setups}
                for _ in range(args.repeats):
                    for name, timed in setups.items():
                        best[name] = min(best[name], per_call_us(timed, args.calls // (1 + 4 * (size > 32))))
                for name, us in best.items():
                    rows.append({"setup": name, "images": images, "size": size, "us_per_request": round(us, 2)})
            scrape = min(
                per_call_us(lambda: generate_latest(registry), 200) for _ in range(args.repeats)
            )  # the drift part of one /metrics answer
        finally:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cpu = f"{platform.machine()} {platform.processor() or ''}".strip()
    print(f"Drift signals per answered request, µs (best of {args.repeats}; {cpu}; numpy {np.__version__})\n")
    print("| setup | images / request | image px | µs / request |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['images']} | {r['size']} | {r['us_per_request']:.1f} |")
    print(f"\nOne scrape of the drift metrics (43 classes, 5 histograms): {scrape:.0f} µs")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "scrape_us": round(scrape, 1), "cpu": cpu}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
