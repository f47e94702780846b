"""The team stack for real (pipeline/tracking/team_stack.py): PostgreSQL + SeaweedFS S3 + an MLflow server on free
loopback ports; a `dvc exp run --queue` sweep of two experiments on small synthetic images tracked into it; then what a
teammate does with the results: the MLflow UI in a real browser, the champion through `mlflow.pyfunc`, the
data through the DVC remote on the same S3 store."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.config import parse_params
from tests.helpers.project import (
    GIT_IDENTITY,
    link_raw_data,
    make_project,
    run,
    run_dvc_queue,
    tiny_pipeline_params,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]  # the sweep: two whole runs, beside the other worker
EXPERIMENTS = {"lr-low": "0.002", "lr-high": "0.006"}
PROMOTED = "lr-high"  # the one `pipeline promote` makes champion after the sweep
DVC = [sys.executable, "-m", "dvc"]


@dataclass
class Sweep:
    stack: Any
    work: Path
    env: dict[str, str]
    experiment_id: str
    params: dict[str, Any]


@pytest.fixture(scope="module")
def stack() -> Iterator[Any]:
    from pipeline.tracking import team_stack

    # Not under pytest's tmp: PostgreSQL runs as its own user when we are root, and must reach its folder.
    root = Path(tempfile.mkdtemp(prefix="team-stack-"))
    root.chmod(0o711)
    try:
        yield team_stack.up(root, team_stack.Ports.free(), mlflow_workers=1)
    finally:
        team_stack.down(root)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def sweep(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    """Two experiments queued with `dvc exp run --queue card -C data/raw -S train.lr=…` and run by `dvc queue start`:
    the documented sweep (docs/experiments.md), whose target needs no Docker engine."""
    from mlflow import MlflowClient

    work, env = make_project(tmp_path_factory.mktemp("sweep"))
    tiny_pipeline_params(work)
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["tracking"]["enabled"] = True
    params["train"]["train_on_val"] = False  # a sweep chooses a recipe: validation held out, val_accuracy reported
    params["evaluate"]["max_drop"] = 1.0  # two tiny models on the sample: each passes its gate
    params["benchmark"]["backends"] = ["onnxruntime", "torch-eager"]  # the speed-up is against default eager
    # Two variants are enough to compare and to serve (fp32, fp32-onnx): the int8 and bf16 ones have their own tests.
    params["optimize"].update({"int8_onnx": False, "bf16": "off"})
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    env = dict(env, MLFLOW_TRACKING_URI=stack.tracking_uri, **GIT_IDENTITY)  # no S3 keys: artifacts are proxied
    run(["git", "add", "-A"], work, env)
    run(["git", "commit", "-qm", "baseline"], work, env)
    for name, lr in EXPERIMENTS.items():
        # as docs/experiments.md queues it: the git-ignored raw data copied into the experiment's fresh copy
        run([*DVC, "exp", "run", "--queue", "card", "-C", "data/raw", "-n", name, "-S", f"train.lr={lr}"], work, env)
    status = run_dvc_queue(work, env)
    assert status.count("Success") == len(EXPERIMENTS), status + run([*DVC, "queue", "logs", "lr-low"], work, env)
    client = MlflowClient(stack.tracking_uri)
    experiment = client.get_experiment_by_name(parse_params(params).tracking.experiment)
    # A sweep compares; it never moves the champion. The team picks one and promotes it on purpose.
    name = parse_params(params).tracking.registered_model_name
    assert client.get_registered_model(name).aliases == {}
    run([*DVC, "exp", "apply", PROMOTED], work, env)
    assert "is the champion" in run([sys.executable, "-m", "pipeline.cli", "promote"], work, env)
    return Sweep(stack, work, env, experiment.experiment_id, params)


def _parents(sweep: Sweep) -> tuple[dict[str, Any], list[Any]]:
    from mlflow import MlflowClient

    runs = MlflowClient(sweep.stack.tracking_uri).search_runs([sweep.experiment_id], max_results=200)
    return {r.info.run_name: r for r in runs if "mlflow.parentRunId" not in r.data.tags}, runs


def test_a_queued_sweep_is_one_parent_run_per_experiment_in_postgres_and_s3(sweep: Sweep) -> None:
    import boto3
    import psycopg2
    from mlflow import MlflowClient

    from pipeline.tracking.team_stack import ARTIFACT_BUCKET

    shown = run([*DVC, "exp", "show", "--json"], sweep.work, sweep.env)
    assert all(f'"{name}"' in shown for name in EXPERIMENTS)
    client = MlflowClient(sweep.stack.tracking_uri)
    assert client.get_experiment(sweep.experiment_id).tags.get("mlflow.experimentKind") == "custom_model_development"
    parents, runs = _parents(sweep)
    top = [r.info.run_name for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert sorted(top) == sorted(EXPERIMENTS), top  # exactly one parent each: every stage found it
    run([*DVC, "exp", "apply", "lr-low"], sweep.work, sweep.env)  # queued runs leave the workspace as it was
    checksum = yaml.safe_load((sweep.work / "data/prepared/manifest.json").read_text())["content_sha256"]
    for name, lr in EXPERIMENTS.items():
        parent = parents[name]
        children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
        assert {"train", "evaluate", "optimize", "benchmark", "card"} <= children, (name, children)
        assert parent.data.params["train.lr"] == lr and "data.image_size" in parent.data.params
        for metric in ("val_accuracy", "test_accuracy", "test_roi_accuracy", "served_accuracy", "served_throughput_b32",
                       "speedup_b32_vs_default_eager", "served_p99_ms", "stage_seconds.train"):  # fmt: skip
            assert metric in parent.data.metrics, (name, metric, sorted(parent.data.metrics))
        assert {d.dataset.digest for d in parent.inputs.dataset_inputs} == {checksum[:36]}
    # Each experiment's shipped variants are MLflow logged models of its optimize run, with their accuracy.
    optimize_runs = {r.info.run_id for r in runs if r.info.run_name == "optimize"}
    logged = client.search_logged_models(experiment_ids=[sweep.experiment_id])
    assert len(optimize_runs) == 2 and {m.source_run_id for m in logged} == optimize_runs
    assert all("accuracy" in {x.key for x in m.metrics or []} for m in logged)
    # Where it all landed: MLflow's tables in PostgreSQL, the artifacts (models included) in the S3 bucket.
    database = sweep.stack.database_uri.replace("postgresql+psycopg2://", "postgresql://")
    with psycopg2.connect(database) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT run_uuid FROM runs WHERE experiment_id = %s", (int(sweep.experiment_id),))
        assert {row[0] for row in cursor.fetchall()} == {r.info.run_id for r in runs}
        cursor.execute("SELECT count(*) FROM model_versions")
        assert cursor.fetchone()[0] >= 2
    s3 = boto3.client("s3", endpoint_url=sweep.stack.s3_endpoint, region_name="us-east-1",
                      aws_access_key_id=sweep.stack.credentials.s3_access_key,
                      aws_secret_access_key=sweep.stack.credentials.s3_secret_key)  # fmt: skip
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=ARTIFACT_BUCKET) for o in page.get("Contents", [])]  # fmt: skip
    assert any(k.endswith("/MLmodel") for k in keys) and any(k.endswith("throughput.png") for k in keys), keys[:20]


def test_the_mlflow_server_runs_no_job_runner(sweep: Sweep) -> None:
    """MLflow's job runner (seven polling processes for GenAI evaluation jobs) is off unless a team sets
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION: the stack's server is the server and its web workers, nothing else."""
    table = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    processes = [line.split(None, 2) for line in table.splitlines() if len(line.split(None, 2)) == 3]
    tree, commands = {sweep.stack.pids["mlflow"]}, []
    for _ in range(4):  # the server, its workers and anything they start
        for pid, ppid, args in processes:
            if int(ppid) in tree and int(pid) not in tree:
                tree.add(int(pid))
                commands.append(args)
    assert commands and not [c for c in commands if "huey" in c], commands


def test_the_champion_loads_with_mlflow_pyfunc_and_classifies_files_as_served(sweep: Sweep) -> None:
    """`models:/<name>-classifier@champion` through the server alone (no S3 keys here): the variant of the experiment
    `pipeline promote` promoted, and on the test split's original files the classes optimize measured it serving."""
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    from pipeline.artifacts.prepared import read_test_files
    from pipeline.artifacts.serving import read as read_choice
    from pipeline.runtimes import read_manifest

    assert "AWS_SECRET_ACCESS_KEY" not in os.environ
    client = MlflowClient(sweep.stack.tracking_uri)
    name = parse_params(sweep.params).tracking.registered_model_name
    champion = client.get_model_version_by_alias(name, "champion")
    optimize_run = client.get_run(champion.run_id)
    experiment = client.get_run(optimize_run.data.tags["mlflow.parentRunId"]).info.run_name
    assert experiment == PROMOTED
    run([*DVC, "exp", "apply", experiment], sweep.work, sweep.env)
    manifest = read_manifest(sweep.work / "models")
    choice = read_choice(sweep.work / "models")
    assert choice is not None and champion.tags["variant"] == choice.variant
    variant = manifest.variant(choice.variant)
    assert champion.tags["sha256"] == variant.sha256
    files = read_test_files(sweep.work / "data" / "prepared")
    assert files and variant.served_predicted
    mlflow.set_tracking_uri(sweep.stack.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    got = model.predict(pd.DataFrame({"image": [f.path.read_bytes() for f in files]}))
    assert list(got["class_id"]) == variant.served_predicted
    accuracy = sum(int(c) == f.label for c, f in zip(got["class_id"], files, strict=True)) / len(files)
    assert accuracy == pytest.approx(variant.served_accuracy)
    print(f"champion {name} v{champion.version} ({choice.variant}, {experiment}): served accuracy {accuracy:.4f} "
          f"on {len(files)} original files through mlflow.pyfunc, 0 differences from the server's")  # fmt: skip


def test_a_teammate_dvc_pulls_the_results_from_the_s3_remote(sweep: Sweep, tmp_path: Path) -> None:
    """`dvc push` to the stack's bucket, a fresh clone, `dvc pull`: the same files, `dvc status card` clean
    (nothing would re-run); the keys stay out of git."""
    from pipeline.tracking.team_stack import dvc_remote

    work, env = sweep.work, sweep.env
    run([*DVC, "exp", "apply", "lr-low"], work, env)
    dvc_remote(sweep.stack.s3_endpoint, sweep.stack.credentials, work)
    run(["git", "add", "-A"], work, env)
    run(["git", "commit", "-qm", "lr-low, with the team remote"], work, env)
    secret = sweep.stack.credentials.s3_secret_key
    assert subprocess.run(["git", "grep", "-q", "-F", secret, "HEAD"], cwd=work).returncode == 1  # not in git
    assert secret in (work / ".dvc" / "config.local").read_text()
    pushed = run([*DVC, "push"], work, env)
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(work), str(clone)], tmp_path, env)
    link_raw_data(clone, (work / "data" / "raw").resolve())  # the teammate's own copy of the raw data, linked
    for key, value in (("access_key_id", sweep.stack.credentials.s3_access_key),
                       ("secret_access_key", sweep.stack.credentials.s3_secret_key)):  # fmt: skip
        run([*DVC, "remote", "modify", "--local", "team", key, value], clone, env)
    run([*DVC, "pull"], clone, env)
    status = run([*DVC, "status", "card"], clone, env)  # the sweep's target: every stage up to the card
    assert "Data and pipelines are up to date" in status, status
    for name in ("models/manifest.json", "models/serving.json", "data/prepared/manifest.json", "reports/model_card.md"):
        assert (clone / name).read_bytes() == (work / name).read_bytes(), name
    print(f"dvc push: {pushed.strip().splitlines()[-1]}; clone pulled, dvc status clean")


def test_the_mlflow_ui_compares_the_two_experiments_in_a_real_browser(sweep: Sweep, tmp_path: Path) -> None:
    """Headless Chromium (Debian's) driven by Playwright: the runs page lists both experiments; the compare page of
    their parent runs shows their served accuracy and throughput. The screenshot is kept (PIPELINE_SCREENSHOTS)."""
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (.ci/run installs Debian's)")
        pytest.skip("no chromium: apt-get install chromium")
    from playwright.sync_api import sync_playwright

    parents, _ = _parents(sweep)
    ids = [parents[name].info.run_id for name in EXPERIMENTS]
    base = sweep.stack.tracking_uri
    shots = Path(os.environ.get("PIPELINE_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        # workflowType: the UI remembers GenAI vs model training per browser; a fresh one starts on GenAI.
        page.goto(f"{base}/#/experiments/{sweep.experiment_id}/runs?workflowType=machine_learning")
        for name in EXPERIMENTS:
            page.get_by_text(name).first.wait_for(timeout=60_000)
        page.screenshot(path=str(shots / "mlflow-runs.png"))
        runs = ",".join(f'"{i}"' for i in ids)
        page.goto(
            f'{base}/#/compare-runs?runs=[{runs}]&experiments=["{sweep.experiment_id}"]&workflowType=machine_learning'
        )
        page.get_by_text("served_throughput_b32").first.wait_for(timeout=60_000)
        text = page.inner_text("body")
        (shots / "mlflow-compare.txt").write_text(text)
        page.get_by_text("served_throughput_b32").first.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "mlflow-compare.png"))
        browser.close()
    on_screen = [float(n) for n in re.findall(r"\d+(?:\.\d+)?", text.split("Metrics")[-1])]
    for name in EXPERIMENTS:
        assert name in text
        metrics = parents[name].data.metrics
        for metric in ("served_accuracy", "served_throughput_b32"):
            assert metric in text
            # the UI rounds (0.1287 shows as 0.129, 0.0233 as 0.023): the value to 3 significant digits or decimals
            assert any(math.isclose(n, metrics[metric], rel_tol=5e-3, abs_tol=5e-4) for n in on_screen), (
                name,
                metric,
                metrics[metric],
            )


def test_platform_commands_refuse_clearly(tmp_path: Path) -> None:
    """`pipeline platform down` with nothing running, `dvc-remote` without a stack: one line each, no traceback."""
    env = dict(os.environ)
    down = subprocess.run([sys.executable, "-m", "pipeline.cli", "platform", "down", "--dir", str(tmp_path)],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert down.returncode == 0 and "no stack running" in down.stdout
    remote = subprocess.run([sys.executable, "-m", "pipeline.cli", "platform", "dvc-remote", "--dir", str(tmp_path)],
                            capture_output=True, text=True, env=env)  # fmt: skip
    assert remote.returncode == 2 and "Traceback" not in remote.stderr and "platform up" in remote.stderr


def test_keys_that_start_with_a_dash_are_values_and_generated_keys_are_hex(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dvc's parser once took a generated secret starting with '-' for an option (and echoed it in the error):
    `--` ends dvc's options, and the keys the stack generates are hex."""
    from pipeline.tracking.team_stack import Credentials, dvc_remote

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    dvc_remote("http://127.0.0.1:9", Credentials("pw", "-access-key", "-390-secret"), tmp_path)
    local = (tmp_path / ".dvc" / "config.local").read_text()
    assert "access_key_id = -access-key" in local and "secret_access_key = -390-secret" in local
    for name in ("TEAM_DB_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    made = Credentials.load(tmp_path / "stack")
    for key in (made.db_password, made.s3_access_key, made.s3_secret_key):
        assert re.fullmatch(r"[0-9a-f]{36}", key), key
