"""pipeline.yml under act (scripts/act.sh, offline): a quick pull-request run of the demo's pipeline on one leg
plus the compare job, on small synthetic images in the demo's layout (the workflow's GTSRB steps read them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.demo import write_synthetic_gtsrb
from tests.helpers.s3 import KEYS, weed_s3
from tests.test_act import act

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


def test_pipeline_workflow_on_a_pull_request_runs_a_leg_and_the_compare_job_and_leaves_the_champion(
    tmp_path: Path, benchmarked_project: Path
) -> None:
    """pipeline.yml once, as a pull request (quick, through the repository variables), on the x86_64 leg and the
    compare job, with the team's DVC remote and MLflow store as secrets: the leg pulls from the remote and pushes
    nothing, evaluate's gate passes and is logged in the store, `champion` stays on the version it named, and the
    compare job merges the leg's benchmark report with the other leg's. Under act both legs are this host and the
    same steps, so the arm64 leg's artifact is seeded from a real benchmark stage run (tests/test_workflows.py checks
    that the matrix has both legs and that the compare job reads both). (A push's `dvc push` and a teammate's
    `dvc pull` run against the team stack in tests/tracking/test_team_stack.py; the champion moving on the default
    branch in tests/stages/test_evaluate.py.)"""
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
    other_leg = tmp_path / "seed" / "pipeline-arm64" / "reports" / "benchmark"
    shutil.copytree(benchmarked_project / "reports" / "benchmark", other_leg)
    with weed_s3() as endpoint:  # the team's DVC remote
        secrets = {"DVC_REMOTE_URL": "s3://dvc/ci", "DVC_REMOTE_ENDPOINT": endpoint, **KEYS,
                   "MLFLOW_TRACKING_URI": store}  # fmt: skip
        flags = [arg for name, value in secrets.items() for arg in ("--secret", f"{name}={value}")]
        result = act("pipeline", "-e", str(event), "--var", "PIPELINE_QUICK=true", "--var", "PIPELINE_EPOCHS=1",
                     "--matrix", "arch:x86_64", *flags, out=tmp_path / "act", data_env={"GTSRB_ROOT": str(gtsrb)},
                     event="pull_request", seed=tmp_path / "seed")  # fmt: skip
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-5000:]
    for job in ("repro (x86_64)", "compare x86 and Arm"):
        assert f"[pipeline/{job}" in log, f"job {job} did not run"
    assert "Job failed" not in log
    assert log.count("Success - Main dvc pull from the team's remote") == 1, "dvc pull: not run on the runner"
    assert "Success - Main dvc push" not in log  # a pull request shares nothing
    artifact = tmp_path / "act" / "pipeline" / "pipeline-x86_64"  # the leg that ran
    report = json.loads((artifact / "reports" / "benchmark" / "report.json").read_text())
    assert any(r["status"] == "ok" for r in report["results"])
    assert (artifact / "models" / "manifest.json").is_file()
    evaluated = json.loads((artifact / "reports" / "evaluate" / "metrics.json").read_text())
    assert evaluated["variant"] == json.loads((artifact / "models" / "serving.json").read_text())["variant"]
    assert (artifact / "data" / "prepared" / "test" / "images-00000.npy").is_file()
    assert list((artifact / "data" / "prepared" / "test_files").iterdir())  # what monitor sends
    assert not (artifact / "models" / "checkpoints").exists()
    assert "epochs: 1" in (artifact / "params.yaml").read_text()
    # The compare job merged both reports; its table went to the job summary (act prints summaries in its log).
    assert "Benchmark: x86 and Arm runners" in log and "| machine | variant |" in log
    assert "no benchmark report from" not in log
    # The leg logged its gate to the team's store and did not move the champion.
    assert log.count("the champion stays where it is (a pull request's run)") == 1, log[-5000:]
    assert client.get_model_version_by_alias(names.registered_model_name, "champion").version == kept.version
    evaluated_runs = client.search_runs(
        [client.get_experiment_by_name(names.experiment).experiment_id], "attributes.run_name = 'evaluate'"
    )
    assert [(r.data.tags["gate"], r.data.tags["promoted"]) for r in evaluated_runs] == [("passed", "no")]
    assert len(client.search_model_versions(f"name='{names.registered_model_name}'")) > 1  # it registered its own
