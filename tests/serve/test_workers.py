"""`serve.workers: 2` for real: two worker processes behind one listening socket both answer; /metrics (served by
either) adds up every worker's requests and images; SIGTERM under keep-alive load loses no request; gRPC is served
by the workers on one port."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from pipeline.machine.ports import free_port
from pipeline.monitoring import drift
from tests.helpers.server import start_server
from tests.serve.test_connection import sigterm_under_load
from tests.serve.test_server import png

pytestmark = pytest.mark.slow


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{name}(\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(2) or "") for k, v in labels.items()):
            total += float(match.group(3))
    return total


def test_two_workers_answer_and_their_metrics_add_up(models_dir: Path, tmp_path: Path) -> None:
    import tritonclient.grpc as triton

    log = tmp_path / "access.log"
    grpc_port = free_port()
    server = start_server(models_dir, tmp_path, {"workers": 2, "grpc_port": grpc_port}, stdout=log)
    try:
        body = png(np.ascontiguousarray(server.test_images[0]))
        pids: set[int] = set()
        sent = 0
        deadline = time.monotonic() + 60
        while (len(pids) < 2 or sent < 40) and time.monotonic() < deadline:
            # a new connection per request: the kernel hands each to whichever worker accepts first
            answer = httpx.post(f"{server.url}/v1/predict", files={"files": ("s.png", body, "image/png")})
            assert answer.status_code == 200
            sent += 1
            time.sleep(0.01)
            pids = {json.loads(line)["pid"] for line in log.read_text().splitlines() if '"/v1/predict"' in line}
        assert len(pids) == 2, f"one worker answered all {sent} requests"
        # gRPC on the same port in every worker
        client = triton.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
        s = server.image_size
        tensor = triton.InferInput("images", [3, 3, s, s], "FP32")
        tensor.set_data_from_numpy(np.zeros((3, 3, s, s), np.float32))
        assert client.infer("signs", [tensor]).as_numpy("class_id").shape == (3,)
        # Either worker's /metrics is the sum of both (ask a few times: several connections, several workers).
        for _ in range(6):
            text = httpx.get(f"{server.url}/metrics").text
            assert _metric(text, "inference_requests_total", route="/v1/predict", status="200") == sent
            assert _metric(text, "inference_images_total") == sent + 3
            # the drift signals too (prometheus_client's multiprocess metrics): every answered image, HTTP and gRPC
            counts = drift.parse_metrics(text, server.classes)
            assert sum(counts.class_counts) == sent + 3 and sum(counts.buckets["confidence"]) == sent + 3
            assert sum(counts.buckets["width"]) == sent  # file sizes: the PNGs only, not the tensors
    finally:
        server.stop()


def test_sigterm_with_two_workers_under_load_loses_no_request(models_dir: Path, tmp_path: Path) -> None:
    totals: Counter[str] = Counter()
    for delay in (0.4, 0.8, 1.2):
        server = start_server(models_dir, tmp_path, {"workers": 2, "drain_timeout_s": 5.0})
        code, outcomes = sigterm_under_load(server, delay)
        assert code == 0, server.process.stderr.read().decode()[-2000:] if server.process.stderr else code
        assert outcomes["200"] > 0
        totals.update(outcomes)
    lost = {k: v for k, v in totals.items() if k.startswith("lost")}
    assert not lost, f"requests lost in the drain: {lost} (all outcomes: {dict(totals)})"
    assert set(totals) <= {"200", "503", "refused"}, dict(totals)
