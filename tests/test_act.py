"""The GitHub workflows run end to end on this machine with act, offline (`scripts/act.sh`, the command in docs/ci.md):
ci.yml with a narrowed test selection and monitor.yml's drift job here; pipeline.yml, a quick pull-request run on
both legs plus the compare job, with the demo's data (tests/demo/test_pipeline_workflow.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import DATA_ROOT_ENVS, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ACT = REPO / ".venv" / "bin" / "act"
if not ACT.exists() and shutil.which("act"):
    ACT = Path(shutil.which("act") or "act")


def act(
    workflow: str,
    *args: str,
    out: Path,
    data_env: dict[str, str] | None = None,
    jobs: int = 1,
    event: str = "workflow_dispatch",
    seed: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """scripts/act.sh WORKFLOW ARGS; `jobs` matrix legs at once (GitHub runs them on separate machines); `data_env`:
    a data source's variable naming the copy the workflow reads (none from this environment otherwise); `seed`: a
    folder of artifacts there before the jobs start (ACT_SEED_ARTIFACTS)."""
    if not ACT.exists():
        pytest.skip("act is not installed (it comes with the dev dependencies: make env)")
    env = {k: v for k, v in os.environ.items() if k not in (*DATA_ROOT_ENVS, "PYTEST_ADDOPTS")}
    env |= {"ACT_BIN": str(ACT), "ACT_OUTPUT_DIR": str(out), "ACT_CONCURRENT_JOBS": str(jobs), "ACT_EVENT": event}
    env |= data_env or {}
    env |= {"ACT_SEED_ARTIFACTS": str(seed)} if seed else {}
    return subprocess.run(
        [str(REPO / "scripts" / "act.sh"), workflow, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=2300,
    )  # fmt: skip


def test_ci_workflow_runs_under_act(tmp_path: Path) -> None:
    # One matrix leg (both map to this host) and a few fast tests in one process: `make test` still lints all, but
    # does not type-check again what this checkout's own `make test` type-checked (mypy's cache does not carry over to
    # the job's copy: 30 CPU s of proving nothing more).
    result = act(
        "ci",
        "--matrix", "runner:ubuntu-latest",
        "--env", "MYPY=:",
        "--env", "PYTEST_WORKERS=0",
        "--input", "pytest-args=-m 'not slow' tests/test_config.py tests/test_workflows.py",
        out=tmp_path,
    )  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    assert "Job succeeded" in log and "Job failed" not in log
    assert "Success - Main Lint, type-check and test" in log
    junit = (tmp_path / "ci" / "junit-ubuntu-latest" / "junit.xml").read_text()
    assert (
        'failures="0"' in junit
        and 'errors="0"' in junit
        and "test_params_yaml_and_the_config_defaults_are_one_set" in junit
    )


def test_monitor_workflows_drift_job_runs_under_act(benchmarked_project: Path, tmp_path: Path) -> None:
    """monitor.yml's drift job against a real local `pipeline serve`: after a replay of the test files it passes
    (and would close the drift issue); after darkened files it fails naming brightness, and the step that opens or
    updates the drift issue runs (the github-script stand-in: no GitHub API offline)."""
    import numpy as np
    from PIL import Image, ImageEnhance

    from pipeline.artifacts import drift_reference
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.serve.client import encode, multipart
    from tests.helpers.server import start_server

    def send(url: str, files: list[bytes]) -> None:
        import httpx

        with httpx.Client(timeout=30) as client:
            for start in range(0, len(files), 8):
                body, content_type = multipart(files[start : start + 8])
                assert (
                    client.post(f"{url}/v1/predict", content=body, headers={"content-type": content_type}).status_code
                    == 200
                )

    originals = [Image.open(f.path).convert("RGB") for f in read_test_files(benchmarked_project / "data" / "prepared")]
    # the variant evaluate counted the reference on (the benchmark's choice, which differs between machines)
    counted_on = drift_reference.read(benchmarked_project / drift_reference.REFERENCE_PATH).variant
    server = start_server(
        benchmarked_project / "models", tmp_path, {"variant": counted_on}, reports_dir=benchmarked_project / "reports"
    )
    try:
        send(server.url, [encode(np.asarray(image)) for image in originals])
        clean = act("monitor", "-j", "drift", "--input", f"url={server.url}", out=tmp_path / "clean")
        log = clean.stdout + clean.stderr
        assert clean.returncode == 0, log[-5000:]
        assert "Success - Main Drift against the served model's reference" in log
        assert "Success - Main Close the drift issue after a clean check" in log
        send(server.url, [encode(ImageEnhance.Brightness(image).enhance(0.2)) for image in originals] * 2)
        drifted = act("monitor", "-j", "drift", "--input", f"url={server.url}", out=tmp_path / "drifted")
        log = drifted.stdout + drifted.stderr
        assert drifted.returncode != 0
        assert "signal(s) drifted" in log and "brightness (PSI" in log, log[-5000:]
        assert "Success - Main Open or update the drift issue" in log and "github-script (act stand-in)" in log
    finally:
        server.stop()
