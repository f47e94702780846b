"""deploy/monitoring/: the alert rules and their unit tests under the real promtool, the Grafana dashboard's queries
as valid PromQL over metrics the real server exposes, and `pipeline monitor --drift` reading a real Prometheus."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pipeline.machine.ports import free_port
from tests.helpers import REPO
from tests.helpers.server import start_server

MONITORING = REPO / "deploy" / "monitoring"
METRIC = re.compile(r"\b(inference_[a-z_]+|up)\b")


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (Debian: apt-get install prometheus)")
    return found


def _dashboard_queries() -> list[str]:
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def _rule_exprs() -> list[str]:
    rules = yaml.safe_load((MONITORING / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def test_the_alert_rules_pass_promtool_and_their_unit_tests_fire(tmp_path: Path) -> None:
    promtool = _tool("promtool")
    for args in (
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts.test.yml", "alerts-week.test.yml"],
        ["check", "config", "prometheus.yml"],
    ):
        done = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    # The unit tests can fail: with the low-confidence threshold raised past the test's 50 %, the alert they expect
    # does not fire and promtool says so.
    shutil.copy(MONITORING / "alerts.test.yml", tmp_path)
    loosened = (MONITORING / "alerts.yml").read_text().replace("ratio_1h > 0.25", "ratio_1h > 0.75")
    (tmp_path / "alerts.yml").write_text(loosened)
    done = subprocess.run([promtool, "test", "rules", "alerts.test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0 and "InferenceLowConfidence" in done.stdout + done.stderr


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """Grafana's $job variable replaced by a regex, each query becomes a recording rule that promtool parses."""
    promtool = _tool("promtool")
    queries = _dashboard_queries()
    assert len(queries) >= 8
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{i}", "expr": q.replace("$job", ".*")} for i, q in enumerate(queries)
    ]}]}  # fmt: skip
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    done = subprocess.run([promtool, "check", "rules", "dashboard.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "broken.yml").write_text(yaml.safe_dump({"groups": [{"name": "x", "rules": [
        {"record": "x:y", "expr": "sum(rate(inference_confidence_count[5m]"}]}]}))  # fmt: skip
    broken = subprocess.run([promtool, "check", "rules", "broken.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert broken.returncode != 0


def test_the_rules_and_the_dashboard_read_only_metrics_the_server_exposes(models_dir: Path, tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    server = start_server(models_dir, tmp_path, {})
    try:
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        server.stop()
    exposed = {s.name for family in text_string_to_metric_families(text) for s in family.samples} | {"up"}
    used = {m for expr in _rule_exprs() + _dashboard_queries() for m in METRIC.findall(expr)}
    assert {"inference_confidence_bucket", "inference_input_brightness_sum", "inference_predictions_total"} <= used
    assert used <= exposed, sorted(used - exposed)


@pytest.fixture(scope="module")
def models_dir(tiny_project: Path) -> Path:
    return tiny_project / "models"


@pytest.mark.slow
def test_monitor_drift_reads_the_signals_from_a_real_prometheus(benchmarked_project: Path, tmp_path: Path) -> None:
    """A real Prometheus scrapes a real `pipeline serve` every second; the test files go through the API; `pipeline
    monitor --drift --prometheus` reads the increase over the window from Prometheus' query API: about the images
    sent (Prometheus extrapolates a little), and no drift (they are the reference's own files)."""
    from PIL import Image

    from pipeline.artifacts import drift_reference
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.serve.client import encode, multipart

    prometheus = _tool("prometheus")
    # the variant evaluate counted the reference on (the benchmark's choice, which differs between machines)
    counted_on = drift_reference.read(benchmarked_project / drift_reference.REFERENCE_PATH).variant
    server = start_server(
        benchmarked_project / "models", tmp_path, {"variant": counted_on}, reports_dir=benchmarked_project / "reports"
    )
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "gtsrb-server", "static_configs": [{"targets": [server.url.split("//")[1]]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [prometheus, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def scraped_count() -> float:
            try:
                answer = httpx.get(f"{url}/api/v1/query", params={"query": "sum(inference_confidence_count)"}).json()
            except (httpx.HTTPError, ValueError):  # not listening yet, or starting (a plain-text 503)
                return -1.0
            result = answer.get("data", {}).get("result", [])
            return float(result[0]["value"][1]) if result else -1.0

        deadline = time.monotonic() + 60
        while scraped_count() < 0:  # up, and one scrape of the server in
            assert process.poll() is None and time.monotonic() < deadline, (
                process.stderr.read() if process.stderr else ""
            )
            time.sleep(0.5)
        originals = read_test_files(benchmarked_project / "data" / "prepared")
        files = [encode(Image.open(f.path)) for f in originals]
        with httpx.Client(timeout=30) as client:
            for start in range(0, len(files), 8):
                body, content_type = multipart(files[start : start + 8])
                assert (
                    client.post(
                        f"{server.url}/v1/predict", content=body, headers={"content-type": content_type}
                    ).status_code
                    == 200
                )
        while scraped_count() < len(files):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        time.sleep(2)  # a few more scrapes after the last request
        done = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "monitor", "--drift", "--url", server.url, "--prometheus", url,
             "--window", "120", "--params", str(REPO / "params.yaml")],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads((tmp_path / "reports" / "monitor" / "drift.json").read_text())
        assert report["ok"] and report["window"].startswith("Prometheus"), report
        assert 0.9 * len(files) <= report["live_images"] <= 1.5 * len(files), (report["live_images"], len(files))
    finally:
        process.terminate()
        process.wait(timeout=30)
        server.stop()
