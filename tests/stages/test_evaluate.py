"""The evaluate stage: it measures the variant the image ships, through the server's code; reports and the gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from pipeline.artifacts import predictions as predictions_file
from pipeline.config import Params, parse_params
from pipeline.errors import StageError
from pipeline.stages import evaluate
from tests.helpers.server import start_server


@pytest.fixture
def project(benchmarked_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the benchmarked tiny project (models, serving.json, prepared data with original files)."""
    work = tmp_path / "project"
    shutil.copytree(benchmarked_project, work, symlinks=True)
    shutil.rmtree(work / "reports" / "evaluate")
    monkeypatch.chdir(work)
    return work


def params_of(work: Path, **evaluate_settings: object) -> Params:
    raw = yaml.safe_load((work / "params.yaml").read_text())
    raw["evaluate"] = raw.get("evaluate", {}) | evaluate_settings
    return parse_params(raw)


def test_it_measures_the_shipped_variant_through_the_servers_loader_and_decode(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The headline is the benchmark's chosen variant (what containerize ships) on the test split's original files,
    whole, decoded by the very function the server decodes requests with, run by the server's model loader."""
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.serve import model as served_model
    from pipeline.serve import protocol

    decoded: list[tuple[bytes, object]] = []
    server_decode = protocol.decode_images

    def spy_decode(images: list[tuple[bytes, object]], *args: object) -> np.ndarray:
        decoded.extend(images)
        return server_decode(images, *args)  # type: ignore[arg-type]

    loaded: list[str] = []
    server_loader = served_model.load_served_model

    def spy_loader(models: Path, config: object) -> served_model.ServedModel:
        opened = server_loader(models, config)  # type: ignore[arg-type]
        loaded.append(opened.variant)
        return opened

    monkeypatch.setattr(protocol, "decode_images", spy_decode)
    monkeypatch.setattr(served_model, "load_served_model", spy_loader)
    evaluate.run(params_of(project))
    shipped = json.loads((project / "models/serving.json").read_text())["variant"]
    originals = read_test_files(project / "data" / "prepared")
    assert loaded == [shipped]
    assert decoded == [(f.read_bytes(), None) for f in originals]
    metrics = json.loads((project / "reports/evaluate/metrics.json").read_text())
    written = predictions_file.read(project / predictions_file.PREDICTIONS_PATH)
    manifest = json.loads((project / "models/manifest.json").read_text())
    sha = next(v["sha256"] for v in manifest["variants"] if v["name"] == shipped)
    assert (
        (metrics["variant"], metrics["model_version"])
        == (written.variant, written.model_version)
        == (shipped, sha[:12])
    )
    served = np.asarray(written.served_predicted)
    labels = np.asarray(written.labels)
    assert len(served) == len(originals) == metrics["images"] > 0
    assert metrics["measured_on"] == "original files, whole"
    assert metrics["accuracy"] == float((served == labels).mean()) == written.served_accuracy
    assert metrics["roi_accuracy"] == float((np.asarray(written.predicted) == labels).mean())
    assert metrics["whole_vs_roi_gap_points"] == round(100 * (metrics["roi_accuracy"] - metrics["accuracy"]), 4)
    assert 0 <= metrics["trained_accuracy"] <= 1 and 0 <= metrics["trained_roi_accuracy"] <= 1
    rows = (project / "reports/evaluate/confusion.csv").read_text().splitlines()
    assert rows[0] == "actual,predicted" and rows[1:] == [
        f"{written.classes[a]},{written.classes[p]}" for a, p in zip(labels, served, strict=True)
    ]
    assert (project / "reports/evaluate/confusion.png").stat().st_size > 0
    assert (project / "reports/evaluate/per_class.png").stat().st_size > 0


def test_its_figures_are_what_the_running_server_answers_file_for_file(project: Path, tmp_path: Path) -> None:
    """`pipeline serve` with the defaults (serve.variant auto) asked with the original files by a plain HTTP client
    (multipart, as curl -F sends them) gives evaluate's class for every file: its accuracy is evaluate's headline."""
    from pipeline.artifacts.prepared import read_test_files

    evaluate.run(params_of(project))
    written = predictions_file.read(project / predictions_file.PREDICTIONS_PATH)
    server = start_server(project / "models", tmp_path, {"variant": "auto"})
    try:
        answers = []
        for f in read_test_files(project / "data" / "prepared"):
            reply = httpx.post(f"{server.url}/v1/predict", files=[("files", (f.path.name, f.read_bytes()))])
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["predictions"][0]["top_k"][0]["class_id"])
        assert httpx.get(f"{server.url}/v2/models/signs").json()["versions"] == [written.model_version]
    finally:
        server.stop()
    assert answers == written.served_predicted
    metrics = json.loads((project / "reports/evaluate/metrics.json").read_text())
    assert metrics["accuracy"] == sum(a == b for a, b in zip(answers, written.labels, strict=True)) / len(answers)


def test_an_explicit_containerize_variant_is_what_it_measures(project: Path) -> None:
    manifest = json.loads((project / "models/manifest.json").read_text())
    onnx = [v["name"] for v in manifest["variants"] if v["format"] == "onnx" and v["accepted"]]
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw.setdefault("containerize", {})["variant"] = onnx[-1]
    evaluate.run(parse_params(raw))
    assert json.loads((project / "reports/evaluate/metrics.json").read_text())["variant"] == onnx[-1]
    raw["containerize"]["variant"] = "no-such-variant"
    with pytest.raises(StageError, match=r"containerize\.variant 'no-such-variant' is not in the manifest"):
        evaluate.run(parse_params(raw))


def test_gate_failure_message_names_the_shipped_variant(project: Path) -> None:
    evaluate.run(params_of(project))
    measured = json.loads((project / "reports/evaluate/metrics.json").read_text())["accuracy"]
    assert measured < 1.0  # the tiny model is not perfect: a gate just above its figure fails
    with pytest.raises(StageError) as failure:
        evaluate.run(params_of(project, min_accuracy=min(1.0, measured + 0.001)))
    message = str(failure.value)
    shipped = json.loads((project / "models/serving.json").read_text())["variant"]
    assert message.startswith(
        f"quality gate failed, {shipped} is not served: test accuracy {measured:.4f} of {shipped} (original files, "
        "whole) against evaluate.min_accuracy"
    )
    assert "\n" not in message
    gate = json.loads((project / "reports/evaluate/gate.json").read_text())
    assert not gate["passed"] and [c["name"] for c in gate["checks"] if not c["passed"]] == ["floor"]


def test_without_the_benchmarks_choice_it_refuses_in_one_line(project: Path) -> None:
    (project / "models/serving.json").unlink()
    with pytest.raises(StageError, match=r"serving\.json") as failure:
        evaluate.run(params_of(project))
    assert "\n" not in str(failure.value)


def test_missing_model_is_a_stage_error(project: Path) -> None:
    (project / "models/model.pt").unlink()
    with pytest.raises(StageError, match="run `pipeline train` first"):
        evaluate.run(params_of(project))


def _make_worse(project: Path) -> str:
    """Turn the shipped ONNX file into a worse model (every logit of class 0 raised: it answers 0 almost always),
    recorded as the same variant in the manifest and the benchmark's choice; returns its sha256."""
    import hashlib

    import onnx
    from onnx import helper, numpy_helper

    choice = json.loads((project / "models/serving.json").read_text())
    manifest = json.loads((project / "models/manifest.json").read_text())
    entry = next(v for v in manifest["variants"] if v["name"] == choice["variant"])
    path = project / "models" / entry["file"]
    model = onnx.load(str(path))
    graph = model.graph
    output = graph.output[0].name
    bias = np.zeros(len(manifest["classes"]), dtype=np.float32)
    bias[0] = 1000.0
    graph.initializer.append(numpy_helper.from_array(bias, "worse_bias"))
    for node in graph.node:  # the last node now writes an inner name; the Add writes the output
        node.output[:] = [f"{output}_inner" if o == output else o for o in node.output]
    graph.node.append(helper.make_node("Add", [f"{output}_inner", "worse_bias"], [output]))
    path.unlink()  # a DVC cache link: write a new file rather than through it
    onnx.save(model, str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    entry["sha256"] = sha
    (project / "models/manifest.json").write_text(json.dumps(manifest))
    choice["sha256"] = sha
    (project / "models/serving.json").write_text(json.dumps(choice))
    return sha


def test_the_gate_compares_with_the_champion_passes_a_first_run_and_stops_a_worse_one(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first run has no champion: the comparative gate passes it and makes it the champion. A worse second model on
    the same test files fails against the champion (measured through its MLflow pyfunc model); the record names both
    figures, and neither `pipeline serve` nor containerize takes the failed variant."""
    import subprocess
    import sys

    import mlflow

    from pipeline.artifacts import variants as variants_file
    from pipeline.machine.ports import free_port
    from pipeline.stages import containerize
    from pipeline.stages.optimize import register_variants

    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["tracking"] = {"enabled": True, "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "shop"}
    raw["name"] = "shop"
    (project / "params.yaml").write_text(yaml.safe_dump(raw))
    params = parse_params(raw)
    mlflow.set_tracking_uri(params.tracking.uri)
    mlflow.set_experiment("shop")
    with mlflow.start_run():
        register_variants(params, variants_file.read_manifest(project / "models"))

    client = mlflow.MlflowClient(params.tracking.uri)
    with monkeypatch.context() as pull_request:  # a pull request's CI run compares and passes, but promotes nothing
        pull_request.setenv("GITHUB_ACTIONS", "true")
        pull_request.setenv("GITHUB_EVENT_NAME", "pull_request")
        evaluate.run(params)
    compared = json.loads((project / "reports/evaluate/gate.json").read_text())
    assert (
        compared["passed"] and compared["not_promoted"] == "a pull request's run" and not compared["promoted_version"]
    )
    assert client.get_registered_model("shop-classifier").aliases == {}

    evaluate.run(params)  # the first run on the default branch: nothing to compare with but the trained model
    first = json.loads((project / "reports/evaluate/gate.json").read_text())
    assert first["passed"] and first["champion"] is None
    assert [c["name"] for c in first["checks"]] == ["trained"]
    champion = client.get_model_version_by_alias("shop-classifier", "champion")
    assert champion.tags["sha256"] == first["sha256"]
    assert first["promoted_version"] == str(champion.version)  # the card says so (model_card.gate_lines)
    from pipeline.serve.champion import registered_as
    from pipeline.serve.model import RegistryVersion

    # serving models/ names the registered version of its file, and that it is the champion
    assert registered_as(params, first["sha256"]) == RegistryVersion("shop-classifier", str(champion.version), True)
    assert registered_as(params, "0" * 64) is None  # a file no version holds

    worse = _make_worse(project)
    with pytest.raises(StageError, match=r"quality gate failed, .* is not served: .*against the champion's") as failed:
        evaluate.run(params)
    gate = json.loads((project / "reports/evaluate/gate.json").read_text())
    assert not gate["passed"] and gate["sha256"] == worse
    assert gate["champion"]["version"] == str(champion.version)
    assert gate["champion"]["accuracy"] == pytest.approx(first["accuracy"])  # the champion, re-measured on these files
    assert gate["accuracy"] < first["accuracy"] - params.evaluate.max_drop
    assert {c["name"] for c in gate["checks"] if not c["passed"]} >= {"champion"}
    assert "\n" not in str(failed.value)
    # The champion stays where it was.
    assert client.get_model_version_by_alias("shop-classifier", "champion").version == champion.version

    served = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "serve", "--port", str(free_port())],
        cwd=project, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert served.returncode == 2 and "failed evaluate's quality gate" in served.stderr, served.stderr
    assert "`pipeline serve --champion`" in served.stderr  # the refusal names the way to serve the champion
    _the_champion_is_served(project, first, str(champion.version))
    with pytest.raises(StageError, match="failed evaluate's quality gate"):
        containerize.run(params)
    # Promoting by hand: never what the gate failed.
    promoted = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "promote"], cwd=project, capture_output=True, text=True, timeout=120
    )
    assert promoted.returncode == 2 and "nothing to promote" in promoted.stderr, promoted.stderr


def _the_champion_is_served(project: Path, first: dict, version: str) -> None:
    """`pipeline serve --champion` downloads the registry's champion, checks its file by sha256, serves it, and says
    which registry version it is; its answers are the champion's (the first run's predictions)."""
    import os

    from pipeline.artifacts.prepared import read_test_files
    from tests.helpers.server import serve_project

    server = serve_project(project, dict(os.environ), "--champion")
    try:
        meta = httpx.get(f"{server.url}/v2/models/shop", timeout=10).json()
        assert meta["parameters"]["registry"] == {"name": "shop-classifier", "version": version, "champion": True}
        assert meta["versions"] == [first["sha256"][:12]]  # the champion's file, not models/' worse one
        files = read_test_files(project / "data" / "prepared")[:8]
        answers = [
            httpx.post(f"{server.url}/v1/predict", files={"file": f.path.read_bytes()}, timeout=30).json()
            for f in files
        ]
        assert all(a["model"]["version"] == first["sha256"][:12] for a in answers), answers[0]
    finally:
        server.stop()
    said = server.process.stderr.read().decode() if server.process.stderr else ""
    assert f"registry version {version} of shop-classifier (the champion)" in said, said
