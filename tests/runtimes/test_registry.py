"""A runtime backend is one file and one line in RUNTIME_BACKENDS: in a copy of the package, a toy backend (ONNX
Runtime with basic graph optimisations, sequential) is listed by optimize for every ONNX variant, timed by the
benchmark stage, chosen to serve, and served by `pipeline serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from pipeline.errors import StageError
from pipeline.runtimes import RUNTIME_BACKENDS, runtimes_for
from tests.helpers.package_copy import package_with
from tests.helpers.params import SYNTHETIC_NAME
from tests.helpers.server import start_server

TOY_BACKEND = '''
"""ONNX Runtime with basic graph optimisations, run sequentially: a second backend for ONNX files."""

from pathlib import Path

import numpy as np

from pipeline.runtimes.base import check_batch


class BasicOnnx:
    name = "onnxruntime-basic"

    def __init__(self, path: Path, variant: str, image_size: int, threads: int | None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if threads:
            options.intra_op_num_threads = threads
        self.variant, self.image_size = variant, image_size
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def predict(self, images: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run(None, {self.input_name: check_batch(images, self.image_size)})
        return np.asarray(logits, dtype=np.float32)


def open_runtime(path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool) -> BasicOnnx:
    return BasicOnnx(path, variant, image_size, threads)
'''
TABLE_LINE = '    "onnxruntime-basic": Backend(("onnx",), "pipeline.runtimes.onnx_basic:open_runtime"),\n'


def test_the_table_orders_the_backends_of_a_format() -> None:
    assert runtimes_for("onnx") == ["onnxruntime"]
    assert runtimes_for("torch-export", first="torch-compile") == ["torch-compile", "torch-eager"]
    assert set(RUNTIME_BACKENDS) == {"onnxruntime", "torch-eager", "torch-compile"}


def test_an_unknown_backend_is_refused_naming_the_table(tiny_project: Path) -> None:
    from pipeline.runtimes import open_runtime

    with pytest.raises(StageError, match="unknown backend 'openvino'; choose one of auto, onnxruntime"):
        open_runtime(tiny_project / "models", "fp32-onnx", backend="openvino")


@pytest.mark.slow
def test_a_new_backend_is_one_file_and_one_line_through_optimize_benchmark_and_serve(
    tiny_project: Path, tmp_path: Path
) -> None:
    code = package_with(tmp_path / "code", "runtimes/onnx_basic.py", TOY_BACKEND, "runtimes/__init__.py",
                        "    ONNXRUNTIME: Backend(", TABLE_LINE)  # fmt: skip

    work = tmp_path / "project"
    shutil.copytree(tiny_project, work, symlinks=True)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1, "profile": False,
                           "backends": ["onnxruntime", "onnxruntime-basic"], "serving_backends": ["onnxruntime-basic"],
                           "max_accuracy_drop": 0.05, "headline_rounds": 0}  # fmt: skip
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(code)}
    for stage in ("optimize", "benchmark"):
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", stage], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    manifest = json.loads((work / "models" / "manifest.json").read_text())
    onnx = [v for v in manifest["variants"] if v["format"] == "onnx" and v["accepted"]]
    assert onnx and all(v["runtimes"] == ["onnxruntime", "onnxruntime-basic"] for v in onnx)
    report = json.loads((work / "reports" / "benchmark" / "report.json").read_text())
    timed = {(r["setup"]["variant"], r["setup"]["backend"]) for r in report["results"] if r["status"] == "ok"}
    assert {(v["name"], "onnxruntime-basic") for v in onnx} <= timed
    choice = json.loads((work / "models" / "serving.json").read_text())
    assert choice["backend"] == "onnxruntime-basic"

    name = SYNTHETIC_NAME  # what start_server's project serves as
    server = start_server(work / "models", tmp_path, {"variant": "auto"}, env=env)
    try:
        metadata = httpx.get(f"{server.url}/v2/models/{name}").json()
        assert metadata["platform"] == "onnxruntime-basic", metadata
        size = manifest["input"]["shape"][-1]
        body = {"inputs": [{"name": "images", "shape": [1, 3, size, size], "datatype": "FP32",
                            "data": np.zeros(3 * size * size).tolist()}]}  # fmt: skip
        answer = httpx.post(f"{server.url}/v2/models/{name}/infer", json=body)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
