"""`python -m benchmarks frontend`: uvicorn and Granian (ASGI, RSGI) serve the null route side by side under wrk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks import frontend, null_route


def test_the_null_route_splits_the_upload_and_refuses_what_is_not_one() -> None:
    import asyncio

    async def call(body: bytes, content_type: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=null_route.asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/predict", content=body, headers={"content-type": content_type})

    boundary = "xyz"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="a.png"\r\n\r\n'
            f"PNGDATA\r\n--{boundary}--\r\n").encode()  # fmt: skip
    ok = asyncio.run(call(body, f"multipart/form-data; boundary={boundary}"))
    assert ok.status_code == 200 and ok.content == null_route.ANSWER
    assert asyncio.run(call(b"{}", "application/json")).status_code == 400


def test_three_front_ends_measured_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("wrk") is None:
        pytest.skip("wrk is not installed (.ci/run installs it)")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "a.ppm")
    out = tmp_path / "frontend.json"
    args = ["--images", str(tmp_path), "--concurrency", "4", "--seconds", "1", "--warmup", "0.2", "--rounds", "1"]
    assert frontend.main([*args, "--out", str(out)]) == 0
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [row["setup"] for row in report["rows"]] == ["uvicorn (tuned)", "granian asgi", "granian rsgi"]
    assert all(row["req_per_s"] > 0 and row["errors"] == 0 and row["cpu_ms_per_req"] > 0 for row in report["rows"])
    assert "| granian rsgi | 4 |" in table and report["machine"]["cpu"]
