"""A runtime backend is one file and one line in RUNTIME_BACKENDS, and nothing outside pipeline/runtimes/ names one:
the stages read what they need from its record. A toy backend (ONNX Runtime with basic graph optimisations,
sequential: tests/runtimes/toy_backend.py) is timed by the benchmark stage, chosen to serve and served, with its line
added in this process; and, in a copy of the package, listed by optimize for every ONNX variant, timed, chosen and
served by `pipeline serve`."""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from pipeline import runtimes
from pipeline.errors import StageError
from pipeline.runtimes import RUNTIME_BACKENDS, Backend, baseline_backend, image_backend, runtimes_for
from tests.helpers import REPO
from tests.helpers.package_copy import package_with
from tests.helpers.params import SYNTHETIC_NAME
from tests.helpers.server import start_server

TOY = "onnxruntime-basic"
TOY_FILE = Path(__file__).with_name("toy_backend.py")  # the backend's one file
# Its one line: at the end of the table (order is preference), where the end-to-end test writes it.
TABLE_LINE = f'    "{TOY}": Backend(("onnx",), "pipeline.runtimes.onnx_basic:open_runtime"),\n'
LAST_LINE = "    TORCH_COMPILE: Backend("  # the table's last entry, one line


def test_the_table_orders_the_backends_of_a_format(monkeypatch: pytest.MonkeyPatch) -> None:
    table = {"a": Backend(("x",), "m:a"), "b": Backend(("x", "y"), "m:b"), "c": Backend(("y",), "m:c")}
    monkeypatch.setattr(runtimes, "RUNTIME_BACKENDS", table)
    assert runtimes_for("x") == ["a", "b"] and runtimes_for("y") == ["b", "c"]
    assert runtimes_for("y", first="c") == ["c", "b"] and runtimes_for("z") == []


def test_each_record_says_what_the_stages_ask_of_it() -> None:
    """What the stages read instead of naming a backend: the server image's backend opens ONNX files without torch,
    the benchmark's baseline is an eager torch backend with the oneDNN settings that opens the trained model's file,
    and every record's entries resolve, its requirements are installed and its untimed formats are its own."""
    image, baseline = RUNTIME_BACKENDS[image_backend()], RUNTIME_BACKENDS[baseline_backend()]
    assert "onnx" in image.formats and not image.torch
    assert baseline.torch and baseline.onednn_settings and "torch-state-dict" in baseline.formats
    assert sum(b.baseline for b in RUNTIME_BACKENDS.values()) == 1
    for name, backend in RUNTIME_BACKENDS.items():
        assert backend.formats and set(backend.untimed) <= set(backend.formats), name
        assert all(callable(pkgutil.resolve_name(entry)) for entry in (backend.opener, backend.profiler) if entry)
        assert all(version(package) for package in backend.requirements), name


def test_no_module_outside_the_table_names_a_backend() -> None:
    """Backend names are spelled in pipeline/runtimes/ only (and in the params' defaults): every other module asks
    the table. The machine facts name the onnxruntime library, whose version the report's header shows."""
    library = {("pipeline/machine/__init__.py", "onnxruntime"), ("pipeline/benchmarking/report.py", "onnxruntime")}
    defaults = ("pipeline/runtimes/", "pipeline/config.py", "pipeline/params/")
    found = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if rel.startswith(defaults):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in RUNTIME_BACKENDS and (rel, node.value) not in library:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == []


def test_an_unknown_backend_is_refused_naming_the_table(tiny_project: Path) -> None:
    from pipeline.runtimes import open_runtime

    with pytest.raises(StageError, match="unknown backend 'openvino'; choose one of auto, onnxruntime"):
        open_runtime(tiny_project / "models", "fp32-onnx", backend="openvino")


def test_a_new_backend_is_benchmarked_chosen_and_served(
    tiny_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The toy backend's file (tests/runtimes/toy_backend.py) and its line in the table, nothing else: the ONNX
    variants list it (as optimize writes them), the benchmark stage times it, chooses it to serve and the server's
    loader opens it. In this process: each setup's worker measures here instead of in a fresh interpreter, which
    would read the table without the line (the slow test below runs them in a copy of the package)."""
    from pipeline.benchmarking import worker
    from pipeline.benchmarking.setups import Result, Setup
    from pipeline.config import BenchmarkConfig, ServeConfig, parse_params
    from pipeline.serve.model import load_served_model
    from pipeline.stages import benchmark

    monkeypatch.setitem(RUNTIME_BACKENDS, TOY, Backend(("onnx",), "tests.runtimes.toy_backend:open_runtime"))

    def in_process(setup: Setup, config: BenchmarkConfig, timeout_s: float, throughput_only: bool = False) -> Result:
        measured = worker.measure(setup, config, throughput_only)
        return Result(setup, "ok", metrics=measured, predicted=measured.pop("predicted", None))

    monkeypatch.setattr(worker, "run_setup", in_process)
    work = tmp_path / "project"
    shutil.copytree(tiny_project, work, symlinks=True)
    manifest_path = work / "models" / "manifest.json"
    manifest_path.unlink()  # written anew: never through a link into the shared project
    manifest = json.loads((tiny_project / "models" / "manifest.json").read_text())
    for v in manifest["variants"]:  # the backends that open its format, in the table's order (optimize's runtimes_for)
        v["runtimes"] = runtimes_for(v["format"])
    manifest_path.write_text(json.dumps(manifest))
    raw = yaml.safe_load((work / "params.yaml").read_text())
    raw["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1, "profile": False,
                        "backends": ["onnxruntime", TOY], "serving_backends": [TOY], "max_accuracy_drop": 0.05,
                        "headline_rounds": 0}  # fmt: skip
    monkeypatch.chdir(work)
    benchmark.run(parse_params(raw))

    onnx = {v["name"] for v in manifest["variants"] if v["format"] == "onnx" and v["accepted"]}
    report = json.loads(Path("reports/benchmark/report.json").read_text())
    timed = {(r["setup"]["variant"], r["setup"]["backend"]) for r in report["results"] if r["status"] == "ok"}
    assert onnx and {(name, TOY) for name in onnx} <= timed and {(name, "onnxruntime") for name in onnx} <= timed
    choice = json.loads(Path("models/serving.json").read_text())
    assert choice["backend"] == TOY and choice["variant"] in onnx
    served = load_served_model(Path("models"), ServeConfig(variant="auto", threads=1))
    assert (served.backend, served.variant) == (TOY, choice["variant"])
    size = manifest["input"]["shape"][-1]
    assert served.probabilities(np.zeros((2, 3, size, size), np.float32)).shape == (2, len(manifest["classes"]))


@pytest.mark.slow
def test_a_new_backend_is_one_file_and_one_line_through_optimize_benchmark_and_serve(
    tiny_project: Path, tmp_path: Path
) -> None:
    code = package_with(tmp_path / "code", "runtimes/onnx_basic.py", TOY_FILE.read_text(), "runtimes/__init__.py",
                        LAST_LINE, TABLE_LINE)  # fmt: skip

    work = tmp_path / "project"
    shutil.copytree(tiny_project, work, symlinks=True)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1, "profile": False,
                           "backends": ["onnxruntime", TOY], "serving_backends": [TOY],
                           "max_accuracy_drop": 0.05, "headline_rounds": 0}  # fmt: skip
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(code)}
    for stage in ("optimize", "benchmark"):
        done = subprocess.run([sys.executable, "-m", "pipeline.cli", stage], cwd=work, env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    manifest = json.loads((work / "models" / "manifest.json").read_text())
    onnx = [v for v in manifest["variants"] if v["format"] == "onnx" and v["accepted"]]
    assert onnx and all(v["runtimes"] == ["onnxruntime", TOY] for v in onnx)
    report = json.loads((work / "reports" / "benchmark" / "report.json").read_text())
    timed = {(r["setup"]["variant"], r["setup"]["backend"]) for r in report["results"] if r["status"] == "ok"}
    assert {(v["name"], TOY) for v in onnx} <= timed
    choice = json.loads((work / "models" / "serving.json").read_text())
    assert choice["backend"] == TOY

    name = SYNTHETIC_NAME  # what start_server's project serves as
    server = start_server(work / "models", tmp_path, {"variant": "auto"}, env=env)
    try:
        metadata = httpx.get(f"{server.url}/v2/models/{name}").json()
        assert metadata["platform"] == TOY, metadata
        size = manifest["input"]["shape"][-1]
        body = {"inputs": [{"name": "images", "shape": [1, 3, size, size], "datatype": "FP32",
                            "data": np.zeros(3 * size * size).tolist()}]}  # fmt: skip
        answer = httpx.post(f"{server.url}/v2/models/{name}/infer", json=body)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
