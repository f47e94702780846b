"""`pipeline monitor` against a real `pipeline serve` process over HTTP (model and data from the real stages on
tiny data): a healthy probe, threshold breaches (latency; errors), an unreachable server, both image sources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from pipeline.config import Params, parse_params
from pipeline.errors import StageError
from pipeline.machine.ports import free_port
from pipeline.monitoring import probe as monitor
from tests.helpers import REPO
from tests.helpers.params import with_test_names
from tests.helpers.server import Server, start_server


@pytest.fixture(scope="module")
def server(tiny_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = start_server(tiny_project / "models", tmp_path_factory.mktemp("monitor-server"), {})
    yield running
    running.stop()


@pytest.fixture
def project(tiny_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory whose data/ is the tiny project's prepared data (reports land here, not there)."""
    work = tmp_path / "probe"
    work.mkdir()
    (work / "data").symlink_to(tiny_project / "data")
    monkeypatch.chdir(work)
    monkeypatch.delenv("PIPELINE_MONITOR_URL", raising=False)
    return work


def params_for(work: Path, **monitor_settings: Any) -> Params:
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["monitor"].update(monitor_settings)
    raw["tracking"] = {"enabled": False}
    with_test_names(raw)  # the name the test server serves
    (work / "params.yaml").write_text(yaml.safe_dump(raw))
    return parse_params(raw)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_MONITOR_URL"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "monitor", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_healthy_server_passes_and_reports(server: Server, project: Path) -> None:
    params = params_for(project, images=0, batch_size=5, concurrency=3, min_accuracy=0.0, max_p99_latency_ms=60000.0)
    report = monitor.run(params, url=server.url)

    # The default source: the test split's original files, whole, as users send them.
    from pipeline.artifacts.prepared import read_manifest, read_test_files
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.serve.protocol import decode_images

    originals = read_test_files(project / "data" / "prepared")
    framing = read_manifest(project / "data" / "prepared").served_framing()
    images = decode_images([(f.read_bytes(), None) for f in originals], framing, MAX_PIXELS)
    expected = server.direct_probabilities(images)
    labels = np.asarray([f.label for f in originals])
    probe = report["probe"]
    assert report["ok"] and report["breaches"] == []
    assert probe["images_sent"] == probe["answered_images"] == len(images)
    assert probe["requests"] == -(-len(images) // 5) and probe["errors"] == 0
    # The PNG round trip is lossless: the accuracy through the API is the model's own on the original files.
    assert probe["correct"] == int((expected.argmax(axis=1) == labels).sum())
    assert 0 < probe["latency_ms"]["p50"] <= probe["latency_ms"]["p99"] <= probe["latency_ms"]["max"]
    # The server's own counters saw exactly the probe's requests.
    assert report["server"]["available"]
    assert report["server"]["predict_requests_during_probe"] == probe["requests"]
    assert report["model"]["variant"] == "fp32-onnx"
    saved = json.loads((project / "reports" / "monitor" / "report.json").read_text())
    assert saved["probe"]["correct"] == probe["correct"]
    assert "### Monitor: OK" in (project / "reports" / "monitor" / "summary.md").read_text()


def test_latency_breach_fails_the_command_in_one_line(server: Server, project: Path) -> None:
    params_for(project, images=20, min_accuracy=0.0, max_p99_latency_ms=0.001)
    result = cli("--url", server.url, cwd=project)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "1 threshold(s) breached" in errors[0] and "p99 latency" in errors[0]
    assert "Traceback" not in result.stderr
    assert "BREACH" in result.stdout  # the table
    report = json.loads((project / "reports" / "monitor" / "report.json").read_text())
    assert not report["ok"] and report["probe"]["errors"] == 0
    assert "**breach**" in (project / "reports" / "monitor" / "summary.md").read_text()


def test_failing_requests_are_an_error_rate_breach(tiny_project: Path, project: Path, tmp_path: Path) -> None:
    strict = start_server(tiny_project / "models", tmp_path, {"max_images_per_request": 1})
    try:
        params = params_for(project, images=12, batch_size=4, max_error_rate=0.1)
        with pytest.raises(StageError, match=r"error rate 1\.0000 \(3/3 requests\)"):
            monitor.run(params, url=strict.url)
    finally:
        strict.stop()
    report = json.loads((project / "reports" / "monitor" / "report.json").read_text())
    assert report["probe"]["requests_by_status"] == {"400": 3}
    assert "no request was answered" in report["breaches"]
    # The server counted the same failures.
    assert report["server"]["failed_requests_total"] >= 3


def test_unreachable_server_is_one_clear_line(project: Path) -> None:
    params_for(project, images=4)
    result = cli("--url", f"http://127.0.0.1:{free_port()}", cwd=project)
    assert result.returncode == 2
    assert result.stderr.startswith("error: monitor: cannot reach the server at http://127.0.0.1:")
    assert "Traceback" not in result.stderr


def test_url_comes_from_option_env_or_params(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = params_for(project).monitor
    with pytest.raises(StageError, match="pass --url URL, set PIPELINE_MONITOR_URL"):
        monitor.resolve_url(config)
    assert monitor.resolve_url(config.model_copy(update={"url": "h:1/"})) == "http://h:1"
    monkeypatch.setenv("PIPELINE_MONITOR_URL", "https://env.example")
    assert monitor.resolve_url(config) == "https://env.example"
    assert monitor.resolve_url(config, "http://opt:2") == "http://opt:2"


def test_the_raw_source_sends_the_same_whole_files_as_the_prepared_originals(tiny_project: Path, project: Path) -> None:
    """`monitor.source: raw` lists the data source's own test split under data.root: the files prepare kept."""
    data = parse_params(yaml.safe_load((tiny_project / "params.yaml").read_text())).data
    files, labels = monitor.labelled_images(params_for(project, images=0))
    params = params_for(project, images=0, source="raw").model_copy(update={"data": data})
    raw_files, raw_labels = monitor.labelled_images(params)
    np.testing.assert_array_equal(raw_labels, labels)
    assert raw_files == files
    crops, crop_labels = monitor.labelled_images(params_for(project, images=0, source="prepared"))
    np.testing.assert_array_equal(crop_labels, labels)
    assert len(crops) == len(files) and crops != files  # the crops are another image than the whole file


def test_the_raw_source_of_data_without_a_test_split_says_so(tmp_path: Path) -> None:
    """A folder of class folders has no test split of its own: one line that names the source and the way out."""
    from PIL import Image

    for label in ("cat", "dog"):
        (tmp_path / "pets" / label).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(tmp_path / "pets" / label / "1.png")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update({"source": "folder", "root": str(tmp_path / "pets")})
    raw["monitor"]["source"] = "raw"
    with pytest.raises(
        StageError, match=r"data\.source folder has no test split of its own: use monitor.source: files"
    ):
        monitor.labelled_images(parse_params(raw))
