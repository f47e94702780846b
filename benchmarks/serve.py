"""Load-test the inference server on loopback: req/s and latency at several concurrency levels for three
server setups, measured side by side in one run, with ratios against the reference setup.

    uv run python -m benchmarks serve --variant int8-onnx --concurrency 1 16 64 --seconds 8

Setups (each a real server process on 127.0.0.1, all started by this script before the first
measurement and stopped at the end; the measurements interleave: for each round and concurrency level,
(a), (b), (c) one after the other, so that a change in the machine's load hits all three alike):
  (a) batching   `pipeline serve`: --variant on ONNX Runtime, dynamic batching (--max-batch-size,
                 --max-delay-ms), POST /v1/predict
  (b) no-batch   the same server and model with serve.max_batch_size 1: one model call per request
  (d) 2-workers  setup (a) with serve.workers 2 (only when asked: --setups a d)
  (c) reference  benchmarks/reference_server.py: the design issue #6 names (Arm's learning path): FastAPI,
                 one async /predict/ route, one uploaded file, PIL + torchvision transforms, one eager
                 PyTorch forward of our fp32 model (models/model.pt) per request
Every request is a multipart upload of one original test file, whole, its own bytes as users send them (the demo's
PPMs, a photo data set's JPEGs; `--send png`: re-encoded as PNG, what deploy's smoke test sends; the script cycles
through 64 of them). The load generator is wrk (Debian/Ubuntu: apt-get install wrk), one thread (-t1), so it takes
at most one core; `--client httpx` uses a Python asyncio client instead (it competes with the server
for the CPU). Before the load, 100 test images are classified one by one through each setup, to show
that all three answer and agree with the labels. Traffic stays on 127.0.0.1; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import numpy as np
import yaml
from PIL import Image

from pipeline.artifacts.prepared import PREPARED_DIR, read_split
from pipeline.machine.ports import free_port

BOUNDARY = "----loadtest7MA4YWxkTrZu0gW"


@dataclass(frozen=True)
class Setup:
    key: str  # a, b, c
    name: str
    description: str
    path: str  # the route that takes the upload
    field: str  # the multipart field name
    ready_path: str
    command: Callable[[int, Path], list[str]]
    predicted_class: Callable[[Any], int]
    body: str = "multipart"  # multipart (one file in `field`) | oip-json (an OIP v2 BYTES tensor, the base64 file)


def files_as_sent(prepared: Path, count: int, send: str = "original") -> list[tuple[bytes, int]]:
    """What users send, with each label: the test split's original files, whole, their bytes as they are (the demo's
    PPMs, the JPEGs a camera wrote) or, with send="png", re-encoded as PNG (as deploy's smoke test sends them); the
    first `count`; the prepared crops as PNG only when prepare kept no files (an older prepare)."""
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.serve.client import encode

    originals = read_test_files(prepared)[:count]
    if originals:
        if send == "original":
            return [(f.path.read_bytes(), f.label) for f in originals]
        return [(encode(Image.open(f.path)), f.label) for f in originals]
    test = read_split("test", prepared)
    return [(encode(image), int(label)) for image, label in zip(test.images[:count], test.labels[:count], strict=True)]


def setups(args: argparse.Namespace, work: Path) -> list[Setup]:
    params = yaml.safe_load(args.params.read_text())

    def serve_params(max_batch_size: int, workers: int = 1) -> Path:
        serve = dict(params.get("serve") or {})
        serve |= {"variant": args.variant, "backend": "onnxruntime", "max_batch_size": max_batch_size}
        serve |= {"max_delay_ms": args.max_delay_ms, "threads": args.threads, "workers": workers}
        path = work / f"params-b{max_batch_size}-w{workers}.yaml"
        path.write_text(yaml.safe_dump({**params, "serve": serve}))
        return path

    batching, single = serve_params(args.max_batch_size), serve_params(1)
    two_workers = serve_params(args.max_batch_size, workers=2)

    def ours(params_file: Path) -> Callable[[int, Path], list[str]]:
        return lambda port, _: [sys.executable, "-m", "pipeline.cli", "serve", "--params", str(params_file),
                                "--port", str(port)]  # fmt: skip

    def top1(answer: Any) -> int:
        return int(answer["predictions"][0]["top_k"][0]["class_id"])

    window = f"{args.max_delay_ms:g} ms window"
    reference = [
        sys.executable, "-m", "benchmarks.reference_server", "--model", str(args.models / "model.pt"),
        "--threads", str(args.reference_threads),
    ]  # fmt: skip
    threads = f"{args.reference_threads} torch thread(s)" if args.reference_threads else "PyTorch's default threads"
    peers = peer_setups(args, work, top1) if args.peers else []
    return [
        *peers,
        Setup(
            "a",
            "batching",
            f"our server, {args.variant} on ONNX Runtime, dynamic batching (max {args.max_batch_size}, {window})",
            "/v1/predict",
            "files",
            "/v2/health/ready",
            ours(batching),
            top1,
        ),
        Setup(
            "b",
            "no-batch",
            f"our server, {args.variant} on ONNX Runtime, max_batch_size 1 (one model call per request)",
            "/v1/predict",
            "files",
            "/v2/health/ready",
            ours(single),
            top1,
        ),
        Setup(
            "d",
            "2-workers",
            "setup (a) with serve.workers 2: two processes on one socket, threads split between them (opt-in: --setups)",
            "/v1/predict",
            "files",
            "/v2/health/ready",
            ours(two_workers),
            top1,
        ),
        Setup(
            "c",
            "reference",
            "Arm learning-path design (benchmarks/reference_server.py): FastAPI async /predict/, PIL + torchvision, "
            f"one eager PyTorch fp32 forward per request, {threads}",
            "/predict/",
            "file",
            "/openapi.json",
            lambda port, _: [*reference, "--port", str(port)],
            lambda answer: int(answer["predicted_class"]),
        ),
    ]


def oip_class(answer: Any) -> int:
    output = next(o for o in answer["outputs"] if o["name"] == "class_id")
    return int(output["data"][0])


def peer_setups(args: argparse.Namespace, work: Path, ours_top1: Callable[[Any], int]) -> list[Setup]:
    """Our server's OIP v2 JSON path, and the peers (benchmarks/peers/) in the --peers interpreter, all serving
    --variant through our model loading and decoding code, each with the batching its docs recommend."""
    python = str(args.peers)
    root = str(Path(__file__).resolve().parents[2])
    models = str(args.models.resolve())
    threads = str(args.threads)
    env = {"PYTHONPATH": root, "PEER_MODELS": models, "PEER_VARIANT": args.variant, "PEER_THREADS": threads,
           "PEER_MAX_BATCH_SIZE": str(args.max_batch_size)}  # fmt: skip

    def with_env(cmd: list[str]) -> list[str]:
        return ["env", *(f"{k}={v}" for k, v in env.items()), *cmd]

    def mlserver(port: int, folder: Path) -> list[str]:
        home = folder / f"mlserver-{port}"
        (home / "gtsrb").mkdir(parents=True, exist_ok=True)
        settings = {"http_port": port, "grpc_port": free_port(), "metrics_port": free_port(), "host": "127.0.0.1",
                    "parallel_workers": 0, "debug": False}  # fmt: skip
        (home / "settings.json").write_text(json.dumps(settings))
        model = {"name": "gtsrb", "implementation": "benchmarks.peers.mlserver_runtime.SignRuntime",
                 "max_batch_size": args.max_batch_size, "max_batch_time": 0.001}  # fmt: skip
        (home / "gtsrb" / "model-settings.json").write_text(json.dumps(model))
        return with_env([python, "-m", "mlserver.cli.main", "start", str(home)])

    ours = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "serve",
        "--params",
        str(work / f"params-b{args.max_batch_size}-w1.yaml"),
    ]
    return [
        Setup("e", "ours-oip", "our server as (a), OIP v2 JSON: one BYTES tensor (the base64 file) per request",
              "/v2/models/gtsrb/infer", "", "/v2/health/ready", lambda port, _: [*ours, "--port", str(port)],
              oip_class, body="oip-json"),
        Setup("f", "litserve", f"LitServe, LitAPI max_batch_size {args.max_batch_size}, batch_timeout 1 ms, fast_queue, "
              "1 worker, multipart", "/predict", "file", "/health",
              lambda port, _: with_env([python, "-m", "benchmarks.peers.litserve_server", "--models", models,
                                        "--variant", args.variant, "--threads", threads, "--port", str(port),
                                        "--max-batch-size", str(args.max_batch_size)]),
              lambda answer: int(answer["class_id"])),
        Setup("g", "bentoml", f"BentoML, batchable API (max_batch_size {args.max_batch_size}, adaptive), a worker per CPU, "
              "multipart", "/classify", "files", "/readyz",
              lambda port, _: with_env([python, "-m", "bentoml", "serve", "benchmarks.peers.bentoml_server:Signs",
                                        "--host", "127.0.0.1", "--port", str(port)]),
              lambda answer: int(answer[0]["class_id"])),  # a batchable API answers a list
        Setup("h", "mlserver", f"MLServer, adaptive batching (max_batch_size {args.max_batch_size}, 1 ms), "
              "parallel_workers 0, OIP v2 JSON", "/v2/models/gtsrb/infer", "", "/v2/models/gtsrb/ready",
              mlserver, oip_class, body="oip-json"),
        Setup("i", "kserve", "KServe ModelServer (kserve.Model, what an InferenceService runs), no batching of its "
              "own (the Go agent sidecar batches on Kubernetes), latency log, per-request log lines and gRPC off, 1 worker, "
              "OIP v2 JSON",
              "/v2/models/gtsrb/infer", "", "/v2/models/gtsrb/ready",
              lambda port, _: with_env([python, "-m", "benchmarks.peers.kserve_server", "--http_port", str(port),
                                        "--model_name", "gtsrb", "--workers", "1", "--configure_logging", "false"]),
              oip_class, body="oip-json"),
        Setup("j", "ray-serve", f"Ray Serve, @serve.batch (max_batch_size {args.max_batch_size}, 1 ms), 1 replica, "
              "multipart", "/predict", "files", "/predict",
              lambda port, _: with_env([python, "-m", "benchmarks.peers.ray_server", "--port", str(port),
                                        "--max-batch-size", str(args.max_batch_size)]),
              lambda answer: int(answer["class_id"])),
    ]  # fmt: skip


def start(setup: Setup, port: int, work: Path) -> subprocess.Popen[bytes]:
    log = (work / f"{setup.name}.log").open("wb")
    return subprocess.Popen(setup.command(port, work), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(setup: Setup, process: subprocess.Popen[bytes], port: int, work: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{setup.name}: server exited:\n{(work / f'{setup.name}.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{setup.ready_path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{setup.name}: server not ready within {timeout_s:.0f} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def accuracy(setup: Setup, port: int, images: list[tuple[bytes, int]]) -> float:
    correct = 0
    with httpx.Client(timeout=30) as client:
        for data, label in images:
            body, content_type = request_body(setup, data)
            response = client.post(
                f"http://127.0.0.1:{port}{setup.path}", content=body, headers={"Content-Type": content_type}
            )
            response.raise_for_status()
            correct += setup.predicted_class(response.json()) == label
    return correct / len(images)


# ---- wrk ---------------------------------------------------------------------------------------------
WRK_SCRIPT = """-- generated by `python -m benchmarks serve`: cycle through pre-built request bodies, report as JSON
local files = {%(files)s}
local requests = {}
local n = 0
init = function(args)
  for i, name in ipairs(files) do
    local f = assert(io.open(name, "rb"))
    local body = f:read("*all")
    f:close()
    requests[i] = wrk.format("POST", "%(path)s", {["Content-Type"] = "%(content_type)s"}, body)
  end
end
request = function()
  n = n %% #requests + 1
  return requests[n]
end
"""
# The end of every wrk script here (appended after the % formatting): the run's figures as one JSON line.
WRK_DONE = """done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK_RESULT {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
    .. '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}\\n',
    summary.requests, summary.duration, latency:percentile(50.0), latency:percentile(99.0),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


def file_type(data: bytes) -> tuple[str, str]:
    """(file name suffix, MIME type) of an image file's bytes, as a browser or curl would label the upload."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format or ""
    except (OSError, ValueError):
        kind = ""
    mime = Image.MIME.get(kind, "application/octet-stream")
    return (f".{kind.lower()}" if kind else ".bin"), mime


def request_body(setup: Setup, image: bytes) -> tuple[bytes, str]:
    """One image file as the setup takes it: a multipart upload in its field (named and typed by its format), or an
    OIP v2 JSON BYTES tensor."""
    if setup.body == "oip-json":
        tensor = {"name": "image_files", "shape": [1], "datatype": "BYTES", "data": [base64.b64encode(image).decode()]}
        return json.dumps({"inputs": [tensor]}).encode(), "application/json"
    suffix, mime = file_type(image)
    head = (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{setup.field}"; filename="sign{suffix}"\r\n'
        f"Content-Type: {mime}\r\n\r\n"
    ).encode()
    return head + image + f"\r\n--{BOUNDARY}--\r\n".encode(), f"multipart/form-data; boundary={BOUNDARY}"


def wrk_script(setup: Setup, files: list[Path], work: Path) -> Path:
    bodies = []
    content_type = ""
    for i, f in enumerate(files):
        body, content_type = request_body(setup, f.read_bytes())
        bodies.append(work / f"{setup.key}-body-{i}.bin")
        bodies[-1].write_bytes(body)
    text = (
        WRK_SCRIPT
        % {"files": ", ".join(json.dumps(str(f)) for f in bodies), "content_type": content_type, "path": setup.path}
        + WRK_DONE
    )
    path = work / f"{setup.name}.lua"
    path.write_text(text)
    return path


def cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process (all its threads) and of its living descendants (a server's
    workers); NaN where /proc is not there."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    if pid not in stats:
        return float("nan")
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, fields in stats.items() if int(fields[1]) == parent and p not in tree]
        tree.update(children)
        frontier.extend(children)
    ticks = sum(int(stats[p][11]) + int(stats[p][12]) for p in tree)
    return ticks / os.sysconf("SC_CLK_TCK")


def run_wrk(wrk: str, script: Path, port: int, concurrency: int, seconds: float) -> dict[str, float]:
    command = [wrk, "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "10s",
               "-s", str(script), f"http://127.0.0.1:{port}/"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("WRK_RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"wrk failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    r = json.loads(line.removeprefix("WRK_RESULT "))
    socket_errors = r["connect"] + r["read"] + r["write"] + r["timeout"]
    return {
        "requests": r["requests"],
        "req_per_s": r["requests"] / (r["duration_us"] / 1e6),
        "p50_ms": r["p50_us"] / 1000,
        "p99_ms": r["p99_us"] / 1000,
        "errors": r["status"] + socket_errors,  # non-2xx/3xx answers + socket errors and timeouts
        "non_2xx": r["status"],
        "socket_errors": socket_errors,
    }


# ---- httpx (fallback) --------------------------------------------------------------------------------
async def httpx_load(
    setup: Setup, port: int, images: list[tuple[bytes, int]], concurrency: int, seconds: float
) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}{setup.path}"
    latencies: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def worker(client: httpx.AsyncClient, offset: int) -> None:
        nonlocal errors
        i = offset
        while time.perf_counter() < stop_at and len(latencies) < 200_000:
            data, _ = images[i % len(images)]
            i += concurrency
            started = time.perf_counter()
            try:
                body, content_type = request_body(setup, data)
                ok = (await client.post(url, content=body, headers={"Content-Type": content_type})).is_success
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - started)
            errors += not ok

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
    }


def model_alone(models: Path, variant: str, threads: int, batch: np.ndarray) -> Callable[[float], float]:
    """img/s of the variant alone at the batch's size, in this process, as the benchmark stage measures it (ONNX
    Runtime, `threads` intra-op threads, 0 = all cores): what serving is compared with (the servers idle)."""
    from pipeline.runtimes import open_runtime

    runtime = open_runtime(models, variant, backend="onnxruntime", threads=threads or None)
    runtime.predict(batch)

    def measure(seconds: float) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            runtime.predict(batch)
            done += len(batch)
        return done / (time.perf_counter() - started)

    return measure


def machine_facts(wrk: str | None) -> dict[str, Any]:
    import onnxruntime
    import torch
    import uvicorn

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    loops = [name for name in ("uvloop", "httptools") if _importable(name)]
    wrk_version = ""
    if wrk:
        wrk_version = subprocess.run([wrk, "--version"], capture_output=True, text=True, check=False).stdout
        wrk_version = wrk_version.split("Copyright")[0].strip().removeprefix("wrk ")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "uvicorn": uvicorn.__version__ + (f" ({' + '.join(loops)})" if loops else " (asyncio + h11)"),
        "wrk": wrk_version,
    }


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepared", type=Path, default=PREPARED_DIR, help="prepared data (its test split is sent)")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--models", type=Path, default=Path("models"))
    parser.add_argument("--variant", default="int8-onnx", help="ONNX variant of setups (a) and (b)")
    parser.add_argument("--max-batch-size", type=int, default=64, help="batch limit of setup (a)")
    parser.add_argument("--max-delay-ms", type=float, default=0.0, help="batching window of setup (a)")
    parser.add_argument("--threads", type=int, default=0, help="serve.threads of (a) and (b) (0 = all cores)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seconds", type=float, default=8.0, help="per setup and concurrency level")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before each measurement")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the grid; each cell reports its median round")
    parser.add_argument("--reference-threads", type=int, default=1,
                        help="torch threads of (c); 0 = PyTorch's default (see docs/results-history.md: on a shared machine "
                        "its OpenMP threads wait on each other, and (c) collapses)")  # fmt: skip
    parser.add_argument("--setups", nargs="+", choices=list("abcdefghij"), default=["a", "b", "c"])
    parser.add_argument("--peers", type=Path, help="Python of an environment with litserve, mlserver, bentoml, "
                        "kserve and ray[serve] (benchmarks/peers/__init__.py): adds (e) ours over OIP v2 JSON, "
                        "(f) LitServe, (g) BentoML, (h) MLServer, (i) KServe's ModelServer, (j) Ray Serve")  # fmt: skip
    parser.add_argument("--client", choices=["wrk", "httpx"], default="wrk")
    parser.add_argument("--send", choices=["original", "png"], default="original",
                        help="each test file's own bytes as users send them (the demo's: PPM; photos: JPEG), or re-encoded "
                        "as PNG (deploy's smoke test)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    wrk = shutil.which("wrk")
    if args.client == "wrk" and wrk is None:
        raise SystemExit(
            "loadtest: wrk not found on PATH. Install it (Debian/Ubuntu: `apt-get install wrk`), "
            "or run with `--client httpx` (a Python client that competes with the servers for the CPU)."
        )
    if not (args.models / "manifest.json").is_file() or not (args.models / "model.pt").is_file():
        raise SystemExit(f"loadtest: no trained model in {args.models}/ (run the pipeline up to optimize first)")
    images = files_as_sent(args.prepared, 645, args.send)
    facts = machine_facts(wrk if args.client == "wrk" else None)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)

    with tempfile.TemporaryDirectory(prefix="loadtest-") as tmp:
        work = Path(tmp)
        files = []
        for i, (data, _) in enumerate(images[:64]):
            files.append(work / f"sign-{i}{file_type(data)[0]}")
            files[-1].write_bytes(data)
        chosen = [s for s in setups(args, work) if s.key in args.setups]
        ports = {s.key: free_port() for s in chosen}
        processes: dict[str, subprocess.Popen[bytes]] = {}
        results: dict[str, dict[int, list[dict[str, float]]]] = {
            s.key: {c: [] for c in args.concurrency} for s in chosen
        }
        try:
            for s in chosen:
                processes[s.key] = start(s, ports[s.key], work)
            for s in chosen:
                wait_ready(s, processes[s.key], ports[s.key], work, timeout_s=300)
                print(f"({s.key}) {s.name}: ready; top-1 on 100 test images "
                      f"{accuracy(s, ports[s.key], images[:100]):.2f}", flush=True)  # fmt: skip
            scripts = {s.key: wrk_script(s, files, work) for s in chosen}
            alone = model_alone(
                args.models, args.variant, args.threads, read_split("test", args.prepared, head=32).model_input()
            )
            alone_rounds: list[float] = []
            load_before = os.getloadavg()
            for round_ in range(args.rounds):
                alone_rounds.append(alone(args.seconds))
                print(
                    f"round {round_ + 1} {args.variant} alone, b32 (no server): {alone_rounds[-1]:.1f} img/s",
                    flush=True,
                )
                for c in args.concurrency:
                    for s in chosen:
                        pid = processes[s.key].pid
                        if args.client == "wrk":
                            assert wrk is not None
                            run_wrk(wrk, scripts[s.key], ports[s.key], c, args.warmup)
                            cpu_before = cpu_seconds(pid)
                            stats = run_wrk(wrk, scripts[s.key], ports[s.key], c, args.seconds)
                        else:
                            asyncio.run(httpx_load(s, ports[s.key], images, c, args.warmup))
                            cpu_before = cpu_seconds(pid)
                            stats = asyncio.run(httpx_load(s, ports[s.key], images, c, args.seconds))
                        stats["server_cpu_ms_per_req"] = (
                            (cpu_seconds(pid) - cpu_before) * 1000 / max(1, stats["requests"])
                        )
                        results[s.key][c].append(stats)
                        print(f"round {round_ + 1} ({s.key}) {s.name:9} c={c:<3} {stats['req_per_s']:8.1f} req/s  "
                              f"p50 {stats['p50_ms']:7.2f} ms  p99 {stats['p99_ms']:7.2f} ms  errors {int(stats['errors'])}  "
                              f"server CPU {stats['server_cpu_ms_per_req']:.2f} ms/req",
                              flush=True)  # fmt: skip
            load_after = os.getloadavg()
        finally:
            for process in processes.values():
                stop(process)

    def cell(key: str, c: int) -> dict[str, float]:
        """The median round by req/s (its own latencies), with the errors of every round."""
        runs = sorted(results[key][c], key=lambda r: r["req_per_s"])
        median = dict(runs[(len(runs) - 1) // 2])
        median["errors"] = sum(r["errors"] for r in runs)
        median["req_per_s_rounds"] = [r["req_per_s"] for r in results[key][c]]  # type: ignore[assignment]
        return median

    table = {s.key: {c: cell(s.key, c) for c in args.concurrency} for s in chosen}
    print(f"\nload average (1 min) {load_before[0]:.1f} before, {load_after[0]:.1f} after; client {args.client}; "
          f"{args.seconds:g} s per cell; {args.rounds} round(s)")  # fmt: skip
    for s in chosen:
        print(f"({s.key}) {s.name}: {s.description}")
    best_alone = float(np.median(alone_rounds))
    print(
        f"{args.variant} alone at b32 (the benchmark stage's figure, measured here each round): {best_alone:,.1f} img/s"
    )
    print(
        "\n| setup | concurrency | req/s | p50 ms | p99 ms | errors | vs (c) | (a) vs (b) | served / model alone b32 | server CPU ms/req |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in chosen:
        for c in args.concurrency:
            r = table[s.key][c]
            ratio = f"{r['req_per_s'] / table['c'][c]['req_per_s']:.2f}x" if "c" in table else ""
            ab = f"{r['req_per_s'] / table['b'][c]['req_per_s']:.2f}x" if s.key == "a" and "b" in table else ""
            served = f"{r['req_per_s'] / best_alone:.0%}" if s.key in "abd" else ""  # one image per request
            print(f"| ({s.key}) {s.name} | {c} | {r['req_per_s']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                  f"{int(r['errors'])} | {ratio} | {ab} | {served} | {r['server_cpu_ms_per_req']:.2f} |")  # fmt: skip
    if args.rounds > 1:
        spread = {
            f"({k}) c={c}": ", ".join(f"{v:.0f}" for v in cast(list[float], table[k][c]["req_per_s_rounds"]))
            for k in table
            for c in args.concurrency
        }
        print("\nreq/s per round: " + "; ".join(f"{k}: {v}" for k, v in spread.items()))
    if args.json:
        report = {
            "machine": facts,
            "load_average": {"before": load_before, "after": load_after},
            "args": {k: str(v) for k, v in vars(args).items()},
            "setups": {s.key: {"name": s.name, "description": s.description} for s in chosen},
            "results": {k: {str(c): v for c, v in by_c.items()} for k, by_c in table.items()},
            "model_alone_b32_img_per_s": {"median": best_alone, "rounds": alone_rounds},
        }
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
