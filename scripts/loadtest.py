"""Load-test the inference server on loopback: req/s and latency at several concurrency levels for
several server setups, measured side by side in one run, with ratios against the reference setup.

    uv run python scripts/loadtest.py --images data/prepared/test.npz --concurrency 1 16 64 --seconds 8

Setups (each a real `pipeline serve` process on 127.0.0.1, started and stopped by this script):
  batching   serve.variant on ONNX Runtime with dynamic batching (the default server)
  no-batch   the same model with max_batch_size 1 (one model call per request)
  reference  the Arm example's design: one eager-PyTorch forward per request (torch fp32, batch 1)
Requests are POST /v1/predict with one real test image each (PNG-encoded). Traffic stays on 127.0.0.1
and every loop is bounded by time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from PIL import Image


@dataclass(frozen=True)
class Setup:
    name: str
    variant: str
    backend: str
    max_batch_size: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def png_images(npz: Path, count: int) -> list[tuple[bytes, int]]:
    with np.load(npz) as data:
        images, labels = data["images"][:count], data["labels"][:count]
    out = []
    for image, label in zip(images, labels, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        out.append((buffer.getvalue(), int(label)))
    return out


def start_server(setup: Setup, port: int, params: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "pipeline.cli", "serve", "--params", str(params), "--port", str(port),
        "--variant", setup.variant, "--backend", setup.backend, "--max-batch-size", str(setup.max_batch_size),
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{setup.name}: server exited: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(process)
    raise SystemExit(f"{setup.name}: server not ready within 120 s")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def load(
    port: int, images: list[tuple[bytes, int]], concurrency: int, seconds: float, max_requests: int
) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/v1/predict"
    latencies: list[float] = []
    errors = 0
    correct = 0
    sent = 0
    stop_at = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient, offset: int) -> None:
        nonlocal errors, correct, sent
        i = offset
        while time.perf_counter() < stop_at and sent < max_requests:
            sent += 1
            data, label = images[i % len(images)]
            i += concurrency
            started = time.perf_counter()
            try:
                response = await client.post(url, files={"files": ("sign.png", data, "image/png")})
                ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - started)
            if not ok:
                errors += 1
            elif response.json()["predictions"][0]["top_k"][0]["class_id"] == label:
                correct += 1

    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        began = time.perf_counter()
        await asyncio.gather(*(worker(client, k) for k in range(concurrency)))
        elapsed = time.perf_counter() - began
    ms = np.array(latencies) * 1000
    return {
        "requests": len(latencies),
        "req_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "errors": errors,
        "accuracy": correct / max(1, len(latencies) - errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, default=Path("data/prepared/test.npz"))
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--variant", default="fp32-onnx", help="variant for the batching / no-batch setups")
    parser.add_argument("--reference-variant", default="fp32", help="torch variant for the reference setup")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="per setup and concurrency level")
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--max-batch-size", type=int, default=64, help="batch limit of the batching setup")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    setups = [
        Setup("batching", args.variant, "onnxruntime", args.max_batch_size),
        Setup("no-batch", args.variant, "onnxruntime", 1),
        Setup("reference", args.reference_variant, "torch-eager", 1),
    ]
    images = png_images(args.images, 645)
    results: dict[str, dict[int, dict[str, float]]] = {}
    for setup in setups:
        port = free_port()
        server = start_server(setup, port, args.params)
        try:
            results[setup.name] = {}
            for concurrency in args.concurrency:
                asyncio.run(load(port, images, concurrency, 1.0, 200))  # warm-up
                stats = asyncio.run(load(port, images, concurrency, args.seconds, args.max_requests))
                results[setup.name][concurrency] = stats
                print(f"{setup.name:9} c={concurrency:<3} {stats['req_per_s']:8.1f} req/s  p50 {stats['p50_ms']:7.2f} ms  "
                      f"p99 {stats['p99_ms']:7.2f} ms  errors {stats['errors']}  acc {stats['accuracy']:.4f}", flush=True)  # fmt: skip
        finally:
            stop_server(server)

    print("\n| setup | concurrency | req/s | p50 ms | p99 ms | errors | req/s vs reference |")
    print("|---|---|---|---|---|---|---|")
    for name, by_c in results.items():
        for concurrency, s in by_c.items():
            ratio = s["req_per_s"] / results["reference"][concurrency]["req_per_s"]
            print(f"| {name} | {concurrency} | {s['req_per_s']:.0f} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | "
                  f"{int(s['errors'])} | {ratio:.1f}x |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
