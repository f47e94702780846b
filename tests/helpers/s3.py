"""A real S3 server for tests: SeaweedFS's `weed mini` gateway on free loopback ports, with one bucket."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

KEYS = {"AWS_ACCESS_KEY_ID": "tests-s3", "AWS_SECRET_ACCESS_KEY": "tests-s3-secret-0123456789"}


@contextlib.contextmanager
def weed_s3(bucket: str = "dvc") -> Iterator[str]:
    """The S3 endpoint URL (keys: KEYS); skips the test when SeaweedFS is not installed (make env installs it)."""
    from pipeline.machine.ports import free_port
    from pipeline.tracking.team_stack import Ports

    weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(weed).exists():
        pytest.skip("SeaweedFS (weed) is not installed: make env")
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"tests-s3-{os.getpid()}-{time.monotonic_ns()}"
    (root / "s3").mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [weed, "mini", f"-dir={root / 's3'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-s3.port={port}",
           "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false", f"-bucket={bucket}"]  # fmt: skip
    cmd += [f"-{key}={value}" for key, value in Ports.free().weed.items()]
    with (root / "s3.log").open("w") as log:
        proc = subprocess.Popen(cmd, env={**os.environ, **KEYS}, stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(endpoint, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, (root / "s3.log").read_text()[-2000:]
                time.sleep(0.5)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)
