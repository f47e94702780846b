"""The GitHub workflows run end to end on this machine with act, offline (`scripts/act.sh`, the command in docs/ci.md):
ci.yml with a narrowed test selection, pipeline.yml once as a quick pull-request run on both legs plus the compare
job, and monitor.yml's drift job."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.gtsrb import write_synthetic_gtsrb
from tests.helpers.s3 import KEYS, weed_s3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ACT = REPO / ".venv" / "bin" / "act"
if not ACT.exists() and shutil.which("act"):
    ACT = Path(shutil.which("act") or "act")


def act(
    workflow: str, *args: str, out: Path, gtsrb: Path | None = None, jobs: int = 1, event: str = "workflow_dispatch"
) -> subprocess.CompletedProcess[str]:
    """scripts/act.sh WORKFLOW ARGS; `jobs` matrix legs at once (GitHub runs them on separate machines)."""
    if not ACT.exists():
        pytest.skip("act is not installed (it comes with the dev dependencies: make env)")
    env = {k: v for k, v in os.environ.items() if k not in ("GTSRB_ROOT", "PYTEST_ADDOPTS")}
    env |= {"ACT_BIN": str(ACT), "ACT_OUTPUT_DIR": str(out), "ACT_CONCURRENT_JOBS": str(jobs), "ACT_EVENT": event}
    if gtsrb:
        env["GTSRB_ROOT"] = str(gtsrb)
    return subprocess.run(
        [str(REPO / "scripts" / "act.sh"), workflow, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=2300,
    )  # fmt: skip


def test_ci_workflow_runs_under_act(tmp_path: Path) -> None:
    # One matrix leg (both map to this host) and a few fast tests: `make test` still lints and type-checks all
    # (with this checkout's mypy cache: a cold one is a minute of type-checking that proves nothing more).
    result = act(
        "ci",
        "--matrix", "runner:ubuntu-latest",
        "--env", f"MYPY_CACHE_DIR={REPO / '.mypy_cache'}",
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


def test_pipeline_workflow_on_a_pull_request_runs_both_legs_and_leaves_the_champion(tmp_path: Path) -> None:
    """pipeline.yml once, as a pull request (quick, through the repository variables), on both legs and the compare
    job, with the team's DVC remote and MLflow store as secrets: each leg pulls from the remote and pushes nothing,
    evaluate's gate passes and is logged in the store, and `champion` stays on the version it named. (A push's
    `dvc push` and a teammate's `dvc pull` run against the team stack in tests/test_team_stack.py; the champion
    moving on the default branch in tests/stages/test_evaluate.py.)"""
    import mlflow

    from pipeline.config import load_params

    # The workflow's mechanics, not the data: small synthetic images.
    gtsrb = write_synthetic_gtsrb(tmp_path / "gtsrb")
    names = load_params(REPO / "params.yaml").tracking  # the demo data's names, as the workflow's run resolves them
    store = f"sqlite:///{tmp_path / 'team.db'}"
    client = mlflow.MlflowClient(store, registry_uri=store)
    client.create_registered_model(names.registered_model_name)
    kept = client.create_model_version(names.registered_model_name, str(tmp_path), tags={"variant": "fp32-onnx"})
    client.set_registered_model_alias(names.registered_model_name, "champion", kept.version)
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"pull_request": {"number": 7, "head": {"ref": "try"}, "base": {"ref": "main"}},
                                 "repository": {"default_branch": "main"}}))  # fmt: skip
    with weed_s3() as endpoint:  # the team's DVC remote
        secrets = {"DVC_REMOTE_URL": "s3://dvc/ci", "DVC_REMOTE_ENDPOINT": endpoint, **KEYS,
                   "MLFLOW_TRACKING_URI": store}  # fmt: skip
        flags = [arg for name, value in secrets.items() for arg in ("--secret", f"{name}={value}")]
        result = act("pipeline", "-e", str(event), "--var", "PIPELINE_QUICK=true", "--var", "PIPELINE_EPOCHS=1",
                     *flags, out=tmp_path / "act", gtsrb=gtsrb, jobs=2, event="pull_request")  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    for job in ("repro (x86_64)", "repro (arm64)", "compare x86 and Arm"):
        assert f"[pipeline/{job}" in log, f"job {job} did not run"
    assert "Job failed" not in log
    assert log.count("Success - Main dvc pull from the team's remote") == 2, "dvc pull: not run on both runners"
    assert "Success - Main dvc push" not in log  # a pull request shares nothing
    for arch in ("x86_64", "arm64"):
        artifact = tmp_path / "act" / "pipeline" / f"pipeline-{arch}"
        report = json.loads((artifact / "reports" / "benchmark" / "report.json").read_text())
        assert any(r["status"] == "ok" for r in report["results"])
        assert (artifact / "models" / "manifest.json").is_file()
        evaluated = json.loads((artifact / "reports" / "evaluate" / "metrics.json").read_text())
        assert evaluated["variant"] == json.loads((artifact / "models" / "serving.json").read_text())["variant"]
        assert (artifact / "data" / "prepared" / "test" / "images-00000.npy").is_file()
        assert list((artifact / "data" / "prepared" / "test_files").iterdir())  # what monitor sends
        assert not (artifact / "models" / "checkpoints").exists()
        assert "epochs: 1" in (artifact / "params.yaml").read_text()
    # The compare job's table went to the job summary (act prints summaries in its log).
    assert "Benchmark: x86 and Arm runners" in log and "| machine | variant |" in log
    # Both legs logged their gate to the team's store; neither moved the champion.
    assert log.count("the champion stays where it is (a pull request's run)") == 2, log[-5000:]
    assert client.get_model_version_by_alias(names.registered_model_name, "champion").version == kept.version
    evaluated_runs = client.search_runs(
        [client.get_experiment_by_name(names.experiment).experiment_id], "attributes.run_name = 'evaluate'"
    )
    assert [(r.data.tags["gate"], r.data.tags["promoted"]) for r in evaluated_runs] == [("passed", "no")] * 2
    assert len(client.search_model_versions(f"name='{names.registered_model_name}'")) > 1  # they registered their own


def test_monitor_workflows_drift_job_runs_under_act(benchmarked_project: Path, tmp_path: Path) -> None:
    """monitor.yml's drift job against a real local `pipeline serve`: after a replay of the test files it passes
    (and would close the drift issue); after darkened files it fails naming brightness, and the step that opens or
    updates the drift issue runs (the github-script stand-in: no GitHub API offline)."""
    import numpy as np
    from PIL import Image, ImageEnhance

    from pipeline.artifacts import drift_reference
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.client import encode, multipart
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
