"""The variant families' table (pipeline/optimize/families): a toy family (tests/optimize/toy_family.py) and its one
line are made and gated by optimize, timed by the benchmark, measured by evaluate and served; a family that params do not ask for is not
made; one whose file cannot be made is rejected with the reason and the rest still ship."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from pipeline.artifacts.variants import TRAINED
from pipeline.optimize.families import VARIANT_FAMILIES

TOY = "fp16-rounded"


def _project(tiny_project: Path, work: Path) -> dict[str, Any]:
    """A copy of the tiny project whose models/ optimize writes anew (never through a link into the shared one)."""
    shutil.copytree(tiny_project, work, symlinks=True)
    for name in ("manifest.json", "serving.json"):
        (work / "models" / name).unlink(missing_ok=True)
    shutil.rmtree(work / "models" / "variants", ignore_errors=True)
    raw = yaml.safe_load((work / "params.yaml").read_text())
    raw["optimize"].update({"int8_onnx": False, "bf16": "off"})  # the trained model's fp32 files and the toy's
    return raw


def test_the_trained_model_is_the_first_family() -> None:
    assert next(iter(VARIANT_FAMILIES)) == TRAINED


def test_a_new_variant_is_made_gated_benchmarked_evaluated_and_served(
    tiny_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process: the benchmark's workers measure here (a fresh interpreter would read the table without the
    line), as tests/runtimes/test_registry.py does for a toy backend."""
    from pipeline.benchmarking import worker
    from pipeline.benchmarking.setups import Result, Setup
    from pipeline.config import BenchmarkConfig, ServeConfig, parse_params
    from pipeline.serve.model import load_served_model
    from pipeline.stages import benchmark, evaluate, optimize

    monkeypatch.setitem(VARIANT_FAMILIES, TOY, "tests.optimize.toy_family")  # the one line

    def in_process(setup: Setup, config: BenchmarkConfig, timeout_s: float, throughput_only: bool = False) -> Result:
        measured = worker.measure(setup, config, throughput_only)
        return Result(setup, "ok", metrics=measured, predicted=measured.pop("predicted", None))

    monkeypatch.setattr(worker, "run_setup", in_process)
    raw = _project(tiny_project, tmp_path / "project")
    raw["benchmark"] = {"threads": [0], "min_seconds": 0.05, "latency_calls": 5, "warmup": 1, "profile": False,
                        "backends": ["onnxruntime"], "max_accuracy_drop": 0.05, "headline_rounds": 0}  # fmt: skip
    raw["containerize"] = {"variant": TOY}  # the image ships it: evaluate measures it
    monkeypatch.chdir(tmp_path / "project")
    optimize.run(parse_params(raw))

    manifest = json.loads(Path("models/manifest.json").read_text())
    made = {v["name"]: v for v in manifest["variants"]}
    assert list(made) == [TRAINED, f"{TRAINED}-onnx", TOY]  # the table's order, nothing the params switched off
    toy = made[TOY]
    assert toy["accepted"] and toy["source"] == TRAINED and Path("models", toy["file"]).is_file()
    assert toy["details"]["gate_accuracy"] >= made[TRAINED]["details"]["gate_accuracy"] - 0.05

    benchmark.run(parse_params(raw))
    report = json.loads(Path("reports/benchmark/report.json").read_text())
    timed = {r["setup"]["variant"] for r in report["results"] if r["status"] == "ok"}
    assert TOY in timed

    evaluate.run(parse_params(raw))
    evaluated = json.loads(Path("reports/evaluate/metrics.json").read_text())
    assert evaluated["variant"] == TOY and evaluated["accuracy"] == pytest.approx(toy["served_accuracy"])

    served = load_served_model(Path("models"), ServeConfig(variant=TOY, threads=1))
    trained = load_served_model(Path("models"), ServeConfig(variant=f"{TRAINED}-onnx", threads=1))
    assert served.variant == TOY
    size = manifest["input"]["shape"][-1]
    images = np.random.default_rng(0).random((8, 3, size, size), dtype=np.float32)
    assert np.allclose(served.probabilities(images), trained.probabilities(images), atol=1e-2)


def test_a_family_that_cannot_be_made_is_rejected_and_the_rest_ship(
    tiny_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.config import parse_params
    from pipeline.optimize import export
    from pipeline.stages import optimize

    monkeypatch.setitem(VARIANT_FAMILIES, TOY, "tests.optimize.toy_family")

    raw = _project(tiny_project, tmp_path / "project")
    monkeypatch.chdir(tmp_path / "project")
    real_export = export.export_onnx

    def export_onnx(model: Any, path: Path, image_size: int) -> Any:
        if path.name.startswith(TOY):
            raise RuntimeError("disk full")
        return real_export(model, path, image_size)

    monkeypatch.setattr(export, "export_onnx", export_onnx)
    optimize.run(parse_params(raw))
    manifest = json.loads(Path("models/manifest.json").read_text())
    made = {v["name"]: v for v in manifest["variants"]}
    assert not made[TOY]["accepted"] and "could not be made: RuntimeError: disk full" in made[TOY]["reason"]
    assert made[TRAINED]["accepted"] and not Path("models/variants", f"{TOY}.onnx").exists()
