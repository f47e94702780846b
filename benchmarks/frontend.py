"""The HTTP front end alone: uvicorn, tuned, against Granian (ASGI and RSGI) on a null inference route, side by side.

    uv run python -m benchmarks frontend --images data/prepared/test_files --concurrency 16 64 --seconds 5 --rounds 3

Each server is one worker process on 127.0.0.1 serving `benchmarks.null_route` (the multipart body split by
the server's own splitter, a fixed answer): what the front end costs per request before decode and model. uvicorn
runs as tuned as it goes (uvloop, httptools, no access log, no Server / Date headers, no proxy headers, no lifespan);
Granian with one runtime thread, uvloop, no websockets, no access log. The load is wrk, one thread, one PNG test
file per request in a multipart upload, as `python -m benchmarks serve` sends; the servers take turns for each round and
concurrency, so the machine's load hits all alike. Per setup: req/s, p50/p99, errors, and the server's CPU time per
request (user + system over its process tree), the median over rounds; the ratio and the CPU saved per request are
against uvicorn. The adoption rule (issue #40): Granian only if it saves >= 0.03 ms per request with every
protection kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from PIL import Image

from benchmarks.serve import BOUNDARY, WRK_DONE, cpu_seconds, run_wrk
from pipeline import machine
from pipeline.machine.ports import free_port

WRK_SCRIPT = """local f = assert(io.open("%(body)s", "rb"))
local body = f:read("*all")
f:close()
local req = wrk.format("POST", "/v1/predict", {["Content-Type"] = "multipart/form-data; boundary=%(boundary)s"}, body)
request = function() return req end
"""


def commands(port: int) -> dict[str, list[str]]:
    py = sys.executable
    granian = [py, "-m", "granian", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--runtime-threads", "1", "--loop", "uvloop", "--no-ws", "--log-level", "warning", "--no-access-log"]  # fmt: skip
    uvicorn = [py, "-m", "uvicorn", "benchmarks.null_route:asgi", "--host", "127.0.0.1", "--port", str(port),
               "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--no-server-header", "--no-date-header",
               "--no-proxy-headers", "--lifespan", "off", "--log-level", "warning"]  # fmt: skip
    return {
        "uvicorn (tuned)": uvicorn,
        "granian asgi": [*granian, "--interface", "asgi", "benchmarks.null_route:asgi"],
        "granian rsgi": [*granian, "--interface", "rsgi", "benchmarks.null_route:rsgi"],
    }


def wait_ready(url: str, body: bytes, proc: subprocess.Popen[bytes]) -> None:
    headers = {"content-type": f"multipart/form-data; boundary={BOUNDARY}"}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}): {' '.join(map(str, proc.args))}")  # type: ignore[arg-type]
        try:
            if httpx.post(url, content=body, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server not ready: {url}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks frontend", description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Path, default=Path("data/prepared/test_files"))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    wrk = shutil.which("wrk")
    if wrk is None:
        print("wrk not found on PATH (Debian/Ubuntu: apt-get install wrk)", file=sys.stderr)
        return 2
    first = next((p for p in sorted(args.images.iterdir()) if p.is_file()), None) if args.images.is_dir() else None
    if first is None:
        print(f"no image files in {args.images}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-frontend-") as tmp:
        work = Path(tmp)
        png = work / "sign.png"
        Image.open(first).convert("RGB").save(png)
        body = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; filename="sign.png"\r\n'
                "Content-Type: image/png\r\n\r\n").encode() + png.read_bytes() + f"\r\n--{BOUNDARY}--\r\n".encode()  # fmt: skip
        (work / "body.bin").write_bytes(body)
        script = work / "null.lua"
        script.write_text(WRK_SCRIPT % {"body": work / "body.bin", "boundary": BOUNDARY} + WRK_DONE)
        ports = {name: free_port() for name in commands(0)}
        procs = {name: subprocess.Popen(commands(port)[name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, port in ports.items()}  # fmt: skip
        samples: dict[tuple[str, int], list[dict[str, float]]] = {}
        try:
            for name, port in ports.items():
                wait_ready(f"http://127.0.0.1:{port}/v1/predict", body, procs[name])
            for round_ in range(args.rounds):
                for c in args.concurrency:
                    for name, port in ports.items():
                        run_wrk(wrk, script, port, c, args.warmup)
                        cpu = cpu_seconds(procs[name].pid)
                        stats = run_wrk(wrk, script, port, c, args.seconds)
                        stats["cpu_ms_per_req"] = (
                            (cpu_seconds(procs[name].pid) - cpu) * 1000 / max(1, stats["requests"])
                        )
                        samples.setdefault((name, c), []).append(stats)
                        print(f"round {round_ + 1} c={c} {name}: {stats['req_per_s']:,.0f} req/s, "
                              f"server CPU {stats['cpu_ms_per_req']:.3f} ms/req, errors {int(stats['errors'])}",
                              file=sys.stderr, flush=True)  # fmt: skip
        finally:
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    rows: list[dict[str, float]] = []
    names: list[str] = []
    for (name, c), runs in samples.items():
        row = {k: statistics.median(r[k] for r in runs) for k in ("req_per_s", "p50_ms", "p99_ms", "cpu_ms_per_req")}
        rows.append({**row, "concurrency": c, "errors": sum(int(r["errors"]) for r in runs)})
        names.append(name)
    facts = machine.facts(with_torch=False)
    versions = {name: machine._version(name) or "-" for name in ("uvicorn", "granian", "uvloop", "httptools")}
    print(
        f"CPU: {facts['cpu']} ({facts['cores']} cores; {', '.join(facts['isa'])}); "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    print(f"one worker each; wrk -t1; median of {args.rounds} rounds of {args.seconds:g} s\n")
    print(
        "| setup | connections | req/s | × uvicorn | p50 ms | p99 ms | errors | server CPU ms/req | saved vs uvicorn |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in zip(names, rows, strict=True):
        base = next(
            r
            for n, r in zip(names, rows, strict=True)
            if n == "uvicorn (tuned)" and r["concurrency"] == row["concurrency"]
        )
        print(f"| {name} | {row['concurrency']} | {row['req_per_s']:,.0f} | "
              f"{row['req_per_s'] / base['req_per_s']:.2f}× | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | "
              f"{row['errors']} | {row['cpu_ms_per_req']:.3f} | {base['cpu_ms_per_req'] - row['cpu_ms_per_req']:+.3f} |")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        table = [{"setup": name, **row} for name, row in zip(names, rows, strict=True)]
        args.out.write_text(
            json.dumps({"machine": facts, "versions": versions, "rounds": args.rounds, "rows": table}, indent=2) + "\n"
        )
    return 0 if all(r["errors"] == 0 for r in rows) else 1
