"""The team tracking stack, on one machine and without Docker: what a team runs when it outgrows sqlite.

    PostgreSQL      MLflow's backend store (runs, params, metrics, registry)
    SeaweedFS S3    artifacts (bucket `mlflow`) and the DVC remote (bucket `dvc`)
    mlflow server   proxies artifacts, so clients need only MLFLOW_TRACKING_URI, never S3 credentials

`pipeline platform up [--dir .platform]` starts the three (data under DIR, kept across restarts), prints the
environment to use them and writes it to DIR/client.env; `pipeline platform down` stops them;
`pipeline platform dvc-remote` points this repository's DVC remote `team` at the S3 bucket (credentials in
`.dvc/config.local`, which git ignores). Credentials come from the environment (TEAM_DB_PASSWORD,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or are generated once into DIR/credentials.env (mode 600): never
from or into git. `deploy/platform/compose.yaml` runs the same three as containers. The tests start one on
free ports (tests/tracking/test_team_stack.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from pipeline.errors import StageError
from pipeline.machine.ports import ensure_free, free_port

ARTIFACT_BUCKET = "mlflow"
DVC_BUCKET = "dvc"
DVC_URL = f"s3://{DVC_BUCKET}/store"  # the team remote's URL (.dvc/config)
DB_NAME = DB_USER = "mlflow"
STATE_FILE = "stack.json"
JOB_EXECUTION_ENV = "MLFLOW_SERVER_ENABLE_JOB_EXECUTION"


@dataclass
class Ports:
    postgres: int = 55432
    s3: int = 8333
    mlflow: int = 5051
    # SeaweedFS's own servers (master, volume, filer, admin) and their gRPC ports: internal, on loopback.
    weed: dict[str, int] = field(
        default_factory=lambda: {
            "master.port": 9333,
            "master.port.grpc": 19333,
            "volume.port": 9340,
            "volume.port.grpc": 19340,
            "filer.port": 8888,
            "filer.port.grpc": 18888,
            "s3.port.grpc": 18333,
            "admin.port": 23646,
            "admin.port.grpc": 33646,
        }
    )

    @classmethod
    def free(cls) -> Ports:
        """Every port free on 127.0.0.1 (tests, or a second stack beside a running one)."""
        return cls(free_port(), free_port(), free_port(), {k: free_port() for k in cls().weed})


@dataclass
class Credentials:
    db_password: str
    s3_access_key: str
    s3_secret_key: str

    @classmethod
    def load(cls, root: Path) -> Credentials:
        """From the environment, else root/credentials.env, else generated into it (mode 600)."""
        path = root / "credentials.env"
        saved: dict[str, str] = {}
        if path.is_file():
            saved = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)

        def pick(name: str) -> str:
            # Hex, not urlsafe base64: a generated key starting with '-' was read as an option by CLIs (dvc).
            return os.environ.get(name) or saved.get(name) or secrets.token_hex(18)

        made = cls(pick("TEAM_DB_PASSWORD"), pick("AWS_ACCESS_KEY_ID"), pick("AWS_SECRET_ACCESS_KEY"))
        if not path.is_file():
            root.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(
                    f"TEAM_DB_PASSWORD={made.db_password}\nAWS_ACCESS_KEY_ID={made.s3_access_key}\n"
                    f"AWS_SECRET_ACCESS_KEY={made.s3_secret_key}\n"
                )
        return made


@dataclass
class Stack:
    root: Path
    ports: Ports
    credentials: Credentials
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def tracking_uri(self) -> str:
        return f"http://127.0.0.1:{self.ports.mlflow}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def database_uri(self) -> str:
        return (
            f"postgresql+psycopg2://{DB_USER}:{self.credentials.db_password}@127.0.0.1:{self.ports.postgres}/{DB_NAME}"
        )

    def s3_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.credentials.s3_access_key,
            "AWS_SECRET_ACCESS_KEY": self.credentials.s3_secret_key,
            "AWS_DEFAULT_REGION": "us-east-1",
            "MLFLOW_S3_ENDPOINT_URL": self.s3_endpoint,
        }

    def save(self) -> None:
        state = {"ports": asdict(self.ports), "pids": self.pids}
        (self.root / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def read(cls, root: Path) -> Stack | None:
        path = root / STATE_FILE
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        return cls(root, Ports(**state["ports"]), Credentials.load(root), state["pids"])


def _pg_bin(tool: str) -> str:
    found = shutil.which(tool)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{tool}"), reverse=True):
        return str(candidate)
    raise StageError(f"PostgreSQL's {tool} not found: install PostgreSQL (Debian: apt-get install postgresql)")


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run its tools as the `postgres` user."""
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise StageError(f"{what} failed: {(done.stderr or done.stdout).strip()[-500:]}")
    return done.stdout


def _start_postgres(stack: Stack) -> None:
    data = stack.root / "postgres"
    if os.geteuid() == 0:
        data.mkdir(parents=True, exist_ok=True)
        shutil.chown(data, "postgres", "postgres")
        data.chmod(0o700)
        if subprocess.run(_as_postgres(["test", "-w", str(data)])).returncode != 0:
            raise StageError(
                f"the postgres user cannot write {data}: give its parent folders o+x, or use --dir elsewhere"
            )
    if not (data / "PG_VERSION").is_file():
        pwfile = stack.root / "postgres.pw"
        pwfile.write_text(stack.credentials.db_password + "\n")
        if os.geteuid() == 0:
            shutil.chown(pwfile, "postgres", "postgres")
        pwfile.chmod(0o600)
        try:
            _run(
                _as_postgres([_pg_bin("initdb"), "-D", str(data), "-U", DB_USER, "-A", "scram-sha-256",
                              f"--pwfile={pwfile}", "-E", "UTF8"]),
                "initdb",
            )  # fmt: skip
        finally:
            pwfile.unlink()
    options = f"-p {stack.ports.postgres} -k {data} -c listen_addresses=127.0.0.1"
    _run(
        _as_postgres(
            [_pg_bin("pg_ctl"), "-D", str(data), "-o", options, "-l", str(data / "server.log"), "-w", "start"]
        ),
        f"PostgreSQL (log: {data / 'server.log'})",
    )
    env = dict(os.environ, PGPASSWORD=stack.credentials.db_password)
    exists = _run(
        [_pg_bin("psql"), "-h", "127.0.0.1", "-p", str(stack.ports.postgres), "-U", DB_USER, "-d", "postgres",
         "-tAc", f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}'"],
        "psql", env,
    )  # fmt: skip
    if not exists.strip():
        _run([_pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(stack.ports.postgres), "-U", DB_USER, DB_NAME],
             "createdb", env)  # fmt: skip


def _spawn(cmd: list[str], log: Path, env: dict[str, str]) -> int:
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process.pid


def _wait(url: str, what: str, pid: int, log: Path, timeout_s: float, ok: tuple[int, ...] = (200,)) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code in ok:
                return
        except httpx.HTTPError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise StageError(f"{what} exited at start; see {log}") from None
        time.sleep(0.5)
    raise StageError(f"{what} did not answer {url} within {timeout_s:.0f} s; see {log}")


def up(root: Path, ports: Ports | None = None, mlflow_workers: int = 2) -> Stack:
    """Start PostgreSQL, SeaweedFS (S3) and an MLflow server using them; data kept under `root`."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if Stack.read(root) is not None:
        raise StageError(f"a stack is already running from {root} (`pipeline platform down --dir {root}` first)")
    stack = Stack(root, ports or Ports(), Credentials.load(root))
    ensure_free("127.0.0.1", stack.ports.postgres, "--postgres-port")
    ensure_free("127.0.0.1", stack.ports.s3, "--s3-port")
    ensure_free("127.0.0.1", stack.ports.mlflow, "--mlflow-port")
    try:
        _start_postgres(stack)
        stack.save()  # from here on, `down` can stop what started
        weed = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
        (root / "s3").mkdir(exist_ok=True)
        weed_cmd = [weed, "mini", f"-dir={root / 's3'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                    f"-s3.port={stack.ports.s3}", "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
                    "-admin.ui=false", f"-bucket={ARTIFACT_BUCKET},{DVC_BUCKET}"]  # fmt: skip
        weed_cmd += [f"-{key}={port}" for key, port in stack.ports.weed.items()]
        env = dict(os.environ, **stack.s3_env())
        stack.pids["s3"] = _spawn(weed_cmd, root / "s3.log", env)
        stack.save()
        # Any answer from the gateway means it is up (an unsigned request gets 403).
        _wait(stack.s3_endpoint, "SeaweedFS", stack.pids["s3"], root / "s3.log", 60, ok=(200, 403))
        _wait_bucket(stack)
        server_env = dict(env, MLFLOW_BACKEND_STORE_URI=stack.database_uri)  # not on the command line (ps)
        # MLflow's job runner (GenAI evaluation jobs) is a pool of polling processes the pipeline never uses: off unless set.
        server_env.setdefault(JOB_EXECUTION_ENV, "false")
        mlflow_cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port",
                      str(stack.ports.mlflow), "--artifacts-destination", f"s3://{ARTIFACT_BUCKET}/artifacts",
                      "--workers", str(mlflow_workers)]  # fmt: skip
        stack.pids["mlflow"] = _spawn(mlflow_cmd, root / "mlflow.log", server_env)
        stack.save()
        _wait(f"{stack.tracking_uri}/health", "mlflow server", stack.pids["mlflow"], root / "mlflow.log", 180)
    except BaseException:
        down(root)
        raise
    (root / "client.env").write_text(client_env(stack))
    return stack


def _wait_bucket(stack: Stack, timeout_s: float = 30) -> None:
    """weed mini creates the buckets just after its gateway answers."""
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=stack.s3_endpoint,
        aws_access_key_id=stack.credentials.s3_access_key,
        aws_secret_access_key=stack.credentials.s3_secret_key,
        region_name="us-east-1",
    )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            names = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
            if {ARTIFACT_BUCKET, DVC_BUCKET} <= names:
                return
        except Exception:  # the gateway may refuse until its filer is ready
            pass
        if time.monotonic() > deadline:
            raise StageError(f"SeaweedFS did not create the buckets; see {stack.root / 's3.log'}")
        time.sleep(0.5)


def client_env(stack: Stack) -> str:
    """What clients need: the tracking server only (artifacts are proxied)."""
    return f"MLFLOW_TRACKING_URI={stack.tracking_uri}\n"


def down(root: Path) -> bool:
    """Stop what `up` started from `root` (data kept); False when nothing was running."""
    root = root.resolve()
    stack = Stack.read(root)
    if stack is None:
        return False
    for name in ("mlflow", "s3"):
        pid = stack.pids.get(name)
        if pid:
            _stop_group(pid)
    if (root / "postgres" / "postmaster.pid").is_file():
        subprocess.run(
            _as_postgres([_pg_bin("pg_ctl"), "-D", str(root / "postgres"), "-m", "fast", "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )
    (root / STATE_FILE).unlink(missing_ok=True)
    return True


def _stop_group(pid: int, timeout_s: float = 20) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):  # reap it when it is our child (tests); otherwise init does
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.2)
    os.killpg(pid, signal.SIGKILL)


def dvc_remote(endpoint: str, credentials: Credentials, repo: Path, name: str = "team") -> None:
    """Make `name` the default DVC remote of `repo`: the stack's `dvc` bucket at the S3 `endpoint`; the keys in
    .dvc/config.local."""
    dvc = [sys.executable, "-m", "dvc"]
    for args in (
        ["remote", "add", "--force", "--default", "--", name, DVC_URL],
        ["remote", "modify", "--", name, "endpointurl", endpoint],
        # `--` ends the options: a key that starts with '-' (set by the user) is a value, not an option.
        ["remote", "modify", "--local", "--", name, "access_key_id", credentials.s3_access_key],
        ["remote", "modify", "--local", "--", name, "secret_access_key", credentials.s3_secret_key],
    ):
        done = subprocess.run([*dvc, *args], cwd=repo, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            error = done.stderr.strip()
            for secret in (credentials.s3_access_key, credentials.s3_secret_key):
                error = error.replace(secret, "<redacted>")  # dvc echoes bad arguments: never print a key
            raise StageError(f"dvc {' '.join(a for a in args[:3] if a != '--')} failed: {error}")


# ---- the same stack as containers: deploy/platform/compose.yaml runs this image three times ----
REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "deploy" / "platform" / "compose.yaml"
PLATFORM_DOCKERFILE = REPO_ROOT / "docker" / "platform.Dockerfile"
PLATFORM_ENTRYPOINT = REPO_ROOT / "docker" / "platform-entrypoint.sh"
PLATFORM_REQUIREMENTS = REPO_ROOT / "docker" / "requirements-platform.in"
PLATFORM_IMAGE = "gtsrb-platform:latest"


def build_image(tag: str = PLATFORM_IMAGE, base_image: str = "local/python:3.11-slim-bookworm") -> float:
    """Build the stack's image (PostgreSQL from Debian; mlflow, psycopg2, boto3, weed from a wheelhouse of uv.lock's
    versions downloaded here, so the build needs no PyPI access). Returns the build's wall time in seconds."""
    import tempfile

    from pipeline.ship import context as ctx
    from pipeline.ship import docker_engine

    engine = docker_engine.find_engine()
    arch = engine.native_platform.split("/")[1]
    docker_engine.ensure_base_image(engine, base_image, arch, "platform image: ")
    wheels = ctx.download_wheels(
        engine.native_platform, ctx.wheel_cache_dir() / f"platform-{arch}", PLATFORM_REQUIREMENTS
    )
    # Beside the wheel cache, so that the wheels are hard links, not copies.
    with tempfile.TemporaryDirectory(prefix="platform-context-", dir=wheels.parent) as tmp:
        context = Path(tmp)
        ctx.stage_wheels(wheels, context / "wheels", engine.native_platform)
        shutil.copy2(PLATFORM_ENTRYPOINT, context / "entrypoint.sh")
        shutil.copy2(PLATFORM_DOCKERFILE, context / "Dockerfile")
        return docker_engine.build(
            engine,
            context,
            context / "Dockerfile",
            [tag],
            {"BASE_IMAGE": base_image},
            progress_prefix="platform image: ",
        )
