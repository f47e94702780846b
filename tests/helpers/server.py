"""A real `pipeline serve` process for tests, on a free loopback port, stopped as a process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

from pipeline.machine.ports import free_port
from tests.helpers import REPO
from tests.helpers.params import with_test_names


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    models_dir: Path
    test_images: np.ndarray  # uint8 [N, S, S, 3], already cropped/resized like training
    classes: list[str]
    max_body: int

    @property
    def image_size(self) -> int:
        return int(self.test_images.shape[1])

    def direct_probabilities(self, batch: np.ndarray) -> np.ndarray:
        """The same variant run in this process through the shared runtime interface."""
        from pipeline.runtimes import open_runtime

        logits = open_runtime(self.models_dir, "fp32-onnx", "onnxruntime").predict(batch)
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    def file_classes(self, files: list[bytes]) -> list[int]:
        """The classes the same variant gives image files framed as served (the server's own decode, here)."""
        from pipeline.config import ServeConfig
        from pipeline.images.preprocess import MAX_PIXELS
        from pipeline.serve.model import load_served_model
        from pipeline.serve.protocol import decode_images

        framing = load_served_model(self.models_dir, ServeConfig(variant="fp32-onnx", threads=1)).framing
        batch = decode_images([(bytes(f), None) for f in files], framing, MAX_PIXELS)
        return [int(c) for c in self.direct_probabilities(batch).argmax(axis=1)]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_server(
    models_dir: Path,
    tmp_path: Path,
    serve: dict[str, Any],
    reports_dir: Path | None = None,
    env: dict[str, str] | None = None,
    stdout: Path | None = None,
) -> Server:
    """Start `pipeline serve` in a fresh project folder whose models/ is `models_dir` (and reports/ `reports_dir`),
    with extra environment variables `env`; its stdout (the access log) goes to the file `stdout` if given."""
    work = tmp_path / f"serve-{time.monotonic_ns()}"
    work.mkdir()
    (work / "models").symlink_to(models_dir)
    if reports_dir is not None:
        (work / "reports").symlink_to(reports_dir)
    params = with_test_names(yaml.safe_load((REPO / "params.yaml").read_text()))  # the served names: the tests'
    port = free_port()
    # The fakes were never through evaluate: tests of the gate itself pass require_gate in `serve`.
    params["serve"] = {"port": port, "max_body_bytes": 256 * 1024, "variant": "fp32-onnx", "require_gate": False,
                       **serve}  # fmt: skip
    params["tracking"] = {"enabled": False}
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    process = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve"],
        cwd=work,
        env={**os.environ, **(env or {})},
        stdout=stdout.open("wb") if stdout else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    return _ready(process, port, models_dir, int(params["serve"]["max_body_bytes"]))


def serve_project(project: Path, env: dict[str, str], *options: str) -> Server:
    """`pipeline serve` in `project` itself: its own params.yaml (names, serve settings) and, with `env`'s PYTHONPATH,
    its own package (a generated project), on a free port, with further command-line `options`."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port), *options], cwd=project,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    params = yaml.safe_load((project / "params.yaml").read_text())
    return _ready(process, port, project / "models", int(params["serve"]["max_body_bytes"]))


def _ready(process: subprocess.Popen[bytes], port: int, models_dir: Path, max_body_bytes: int) -> Server:
    """The started server once it answers ready, with the test images and classes of the model it serves."""
    from pipeline.artifacts.prepared import read_split
    from pipeline.runtimes import read_manifest

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if process.poll() is not None:
            raise AssertionError(f"server exited early: {process.stderr.read().decode() if process.stderr else ''}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("server not ready within 90 s")
        time.sleep(0.2)
    images = read_split("test", models_dir.parent / "data" / "prepared").images
    classes = list(read_manifest(models_dir).classes)
    return Server(url, process, models_dir, images, classes, max_body_bytes)
