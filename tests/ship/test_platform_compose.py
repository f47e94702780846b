"""The team stack as containers, for real: `pipeline platform image` builds the image from the project's own base,
Compose runs deploy/platform/compose.yaml (PostgreSQL, SeaweedFS S3, MLflow server) on free loopback ports; a
client with nothing but MLFLOW_TRACKING_URI logs a run whose rows land in PostgreSQL and whose artifact lands in
S3 and comes back; the data survive `down` + `up`; the DVC remote works against the same gateway; credentials
stay out of the image and out of the compose file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.machine.ports import free_port
from pipeline.tracking import team_stack
from tests.helpers import REPO
from tests.helpers.project import GIT_IDENTITY
from tests.ship.conftest import DEFAULT_TEST_BASE, engine_or_skip

pytestmark = [pytest.mark.slow, pytest.mark.docker]
IMAGE = "gtsrb-platform-test:latest"


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) where the CLI has it, else Debian's docker-compose 1.29."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("PIPELINE_REQUIRE_DOCKER"):
        pytest.fail("PIPELINE_REQUIRE_DOCKER is set but neither `docker compose` nor `docker-compose` is installed")
    pytest.skip("no Docker Compose (docker compose plugin or docker-compose)")


@dataclass
class ComposeStack:
    command: list[str]
    folder: Path  # holds credentials.env, the env file Compose reads
    env: dict[str, str]
    credentials: team_stack.Credentials
    s3_port: int
    mlflow_port: int

    def compose(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.command, "-f", str(team_stack.COMPOSE_FILE), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check:
            assert done.returncode == 0, done.stdout + done.stderr
        return done

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def up(self) -> None:
        self.compose("up", "-d")
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            states = {
                service: subprocess.run(
                    ["docker", "inspect", "-f", "{{.State.Health.Status}}", self.container(service)],
                    capture_output=True,
                    text=True,
                ).stdout.strip()
                for service in ("postgres", "s3", "mlflow")
            }
            if set(states.values()) == {"healthy"}:
                return
            time.sleep(2)
        raise AssertionError(f"not healthy within 240 s: {states}\n{self.compose('logs', '--tail', '30').stdout}")

    def psql(self, sql: str) -> str:
        done = subprocess.run(
            ["docker", "exec", "-e", f"PGPASSWORD={self.credentials.db_password}", self.container("postgres"),
             "psql", "-h", "127.0.0.1", "-U", "mlflow", "-d", "mlflow", "-tAc", sql],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    engine_or_skip()
    command = compose_command()
    team_stack.build_image(IMAGE, os.environ.get("PIPELINE_TEST_BASE_IMAGE", DEFAULT_TEST_BASE))
    folder = tmp_path_factory.mktemp("platform")
    credentials = team_stack.Credentials.load(folder)  # generated: the test's own, like a fresh team's
    s3_port, mlflow_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TEAM_", "MLFLOW_"))},
        "COMPOSE_PROJECT_NAME": f"platformtest{os.getpid()}",
        "PLATFORM_IMAGE": IMAGE,
        "S3_PORT": str(s3_port),
        "MLFLOW_PORT": str(mlflow_port),
        "MLFLOW_WORKERS": "1",
    }
    # The credentials as a team passes them: the env file `pipeline platform image` writes.
    env_file = folder / "credentials.env"
    made = ComposeStack([*command, "--env-file", str(env_file)], folder, env, credentials, s3_port, mlflow_port)
    try:
        made.up()
        yield made
    finally:
        made.compose("down", "-v", check=False)


def client(stack: ComposeStack, code: str, cwd: Path) -> str:
    """Python with only MLFLOW_TRACKING_URI: no S3 keys, no endpoint (artifacts are proxied or presigned)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{stack.mlflow_port}"
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().splitlines()[-1]


LOG_RUN = """
    import json, pathlib, mlflow
    mlflow.set_experiment("compose")
    with mlflow.start_run() as run:
        mlflow.log_param("lr", 0.003)
        mlflow.log_metric("served_accuracy", 0.986)
        pathlib.Path("report.json").write_text('{"ok": true}')
        mlflow.log_artifact("report.json")
    print(json.dumps({"run_id": run.info.run_id, "experiment_id": run.info.experiment_id}))
"""

READ_RUN = """
    import json, mlflow
    run = mlflow.get_run("{run_id}")
    path = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="report.json")
    print(json.dumps({{"lr": run.data.params["lr"], "acc": run.data.metrics["served_accuracy"],
                       "report": open(path).read()}}))
"""


def test_a_run_lands_in_postgresql_and_s3_and_survives_a_restart(stack: ComposeStack, tmp_path: Path) -> None:
    import boto3

    logged = json.loads(client(stack, LOG_RUN, tmp_path))
    run_id = logged["run_id"]
    # The run's rows are PostgreSQL's, its artifact an object in the S3 bucket.
    assert stack.psql(f"SELECT status FROM runs WHERE run_uuid = '{run_id}'") == "FINISHED"
    assert stack.psql(f"SELECT value FROM params WHERE run_uuid = '{run_id}' AND key = 'lr'") == "0.003"
    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{stack.s3_port}",
        aws_access_key_id=stack.credentials.s3_access_key,
        aws_secret_access_key=stack.credentials.s3_secret_key,
        region_name="us-east-1",
    )
    key = f"artifacts/{logged['experiment_id']}/{run_id}/artifacts/report.json"
    assert s3.get_object(Bucket=team_stack.ARTIFACT_BUCKET, Key=key)["Body"].read() == b'{"ok": true}'
    # Downloads go straight to S3 through presigned URLs: they must name an address the client reaches.
    expected = {"lr": "0.003", "acc": 0.986, "report": '{"ok": true}'}
    assert json.loads(client(stack, READ_RUN.format(run_id=run_id), tmp_path)) == expected
    # Named volumes keep everything across down + up.
    stack.compose("down")
    stack.up()
    assert json.loads(client(stack, READ_RUN.format(run_id=run_id), tmp_path)) == expected


def test_the_dvc_remote_round_trips_through_the_same_gateway(stack: ComposeStack, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, **GIT_IDENTITY}
    dvc = [sys.executable, "-m", "dvc"]

    def run(*cmd: str) -> str:
        done = subprocess.run(list(cmd), cwd=repo, env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    run("git", "init", "-q")
    run(*dvc, "init", "-q")
    (repo / "data.bin").write_bytes(os.urandom(4096))
    original = (repo / "data.bin").read_bytes()
    run(*dvc, "add", "-q", "data.bin")
    # The CLI a user runs for the compose stack: the gateway's URL, the keys from the env file's folder.
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "platform", "dvc-remote", "--dir",
         str(stack.folder), "--endpoint", f"http://127.0.0.1:{stack.s3_port}"],
        cwd=repo, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert stack.credentials.s3_secret_key not in (repo / ".dvc" / "config").read_text()  # keys: config.local only
    run(*dvc, "push", "-q")
    (repo / "data.bin").unlink()
    shutil.rmtree(repo / ".dvc" / "cache")
    run(*dvc, "pull", "-q")
    assert (repo / "data.bin").read_bytes() == original


def test_no_credential_is_in_the_image_or_the_compose_file(stack: ComposeStack) -> None:
    secrets = [stack.credentials.db_password, stack.credentials.s3_access_key, stack.credentials.s3_secret_key]
    image = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, text=True).stdout
    history = subprocess.run(["docker", "history", "--no-trunc", IMAGE], capture_output=True, text=True).stdout
    compose_file = team_stack.COMPOSE_FILE.read_text()
    for secret in secrets:
        assert secret not in image and secret not in history and secret not in compose_file
    # Without credentials Compose refuses to start, naming what is missing.
    without_env_file = [
        arg for arg in stack.command if arg not in ("--env-file", str(stack.folder / "credentials.env"))
    ]
    done = subprocess.run(
        [*without_env_file, "-f", str(team_stack.COMPOSE_FILE), "config"],
        capture_output=True, text=True, env=stack.env, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "TEAM_DB_PASSWORD" in done.stdout + done.stderr
