"""Running the server image: start a container (read-only root, no capabilities), wait until ready, stop it;
push an image to a registry and pull it back by digest."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

from pipeline.console import log
from pipeline.errors import StageError
from pipeline.ship import docker_engine as eng

CONTAINER_PORT = 8000


@dataclass
class Running:
    name: str
    url: str
    ready_seconds: float


def remove(engine: eng.DockerEngine, name: str) -> None:
    """Remove the container called `name` if there is one (ours: deploy always uses its own name)."""
    eng.docker(engine, ["rm", "-f", name], check=False, timeout_s=60)


def start(
    engine: eng.DockerEngine,
    ref: str,
    name: str,
    host_port: int = 0,
    ready_timeout_s: float = 60.0,
    extra_args: list[str] | None = None,
) -> Running:
    """`docker run` the server hardened as in Kubernetes (read-only root, tmpfs /tmp, no capabilities, no
    privilege escalation), published on 127.0.0.1; returns once /v2/health/ready answers 200."""
    remove(engine, name)
    publish = f"127.0.0.1:{host_port}:{CONTAINER_PORT}" if host_port else f"127.0.0.1::{CONTAINER_PORT}"
    args = [
        "run",
        "-d",
        "--name",
        name,
        "--read-only",
        "--tmpfs",
        "/tmp:rw,nosuid,nodev,size=64m",
        "--cap-drop",
        "ALL",
        "--security-opt",
        "no-new-privileges",
        "--memory",
        "1g",
        "-p",
        publish,
        *(extra_args or []),
        ref,
    ]
    started = time.perf_counter()
    eng.docker(engine, args, timeout_s=120)
    port_line = eng.docker(engine, ["port", name, str(CONTAINER_PORT)], timeout_s=30).stdout.strip().splitlines()
    match = re.search(r":(\d+)$", port_line[0]) if port_line else None
    if match is None:
        raise StageError(f"cannot tell the published port of container {name}: {port_line}")
    url = f"http://127.0.0.1:{match.group(1)}"
    remaining = ready_timeout_s - (time.perf_counter() - started)
    eng.wait_ready(f"{url}/v2/health/ready", max(1.0, remaining), container=name, engine=engine)
    return Running(name=name, url=url, ready_seconds=time.perf_counter() - started)


def stop(engine: eng.DockerEngine, name: str, timeout_s: int = 10) -> tuple[float, int]:
    """`docker stop` (the image's STOPSIGNAL, then SIGKILL after `timeout_s`); returns (seconds, exit code)."""
    started = time.perf_counter()
    eng.docker(engine, ["stop", "-t", str(timeout_s), name], timeout_s=timeout_s + 60)
    seconds = time.perf_counter() - started
    code = eng.docker(engine, ["inspect", "-f", "{{.State.ExitCode}}", name], timeout_s=30).stdout.strip()
    return seconds, int(code or -1)


def logs(engine: eng.DockerEngine, name: str, tail: int = 50) -> str:
    proc = eng.docker(engine, ["logs", "--tail", str(tail), name], check=False, timeout_s=30)
    return (proc.stdout + proc.stderr).strip()


def push(engine: eng.DockerEngine, local_ref: str, remote: str) -> str:
    """Tag `local_ref` as `remote` (registry/repository:tag), push it; returns `registry/repository@digest`."""
    eng.docker(engine, ["tag", local_ref, remote], timeout_s=60)
    layers = 0

    def on_line(line: str) -> None:  # the engine's progress, condensed: one line per layer, none per byte
        nonlocal layers
        if line.endswith((": Pushed", ": Layer already exists")) or ": Mounted from " in line:
            layers += 1
            log(f"deploy: push {remote}: layer {layers} {line.split(': ', 1)[1].lower()} ({line.split(':')[0]})")

    code, out = eng.stream([engine.cli, "push", remote], dict(os.environ), 1800, on_line)
    if code != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise StageError(
            f"docker push {remote} "
            + ("did not finish in 1800 s" if code is None else f"failed (exit {code})")
            + f":\n{tail}"
        )
    match = re.search(r"digest: (sha256:[0-9a-f]{64})", out)
    if match is None:
        raise StageError(f"docker push {remote}: no digest in its output:\n{out[-500:]}")
    repository = remote.rsplit(":", 1)[0] if ":" in remote.rsplit("/", 1)[-1] else remote
    return f"{repository}@{match.group(1)}"


def pull(engine: eng.DockerEngine, ref: str) -> float:
    started = time.perf_counter()
    eng.docker(engine, ["pull", ref], timeout_s=1800)
    return time.perf_counter() - started


def registry_answers(registry: str, timeout_s: float = 3.0) -> bool:
    import urllib.error
    import urllib.request

    for scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(f"{scheme}://{registry}/v2/", timeout=timeout_s):
                return True
        except urllib.error.HTTPError as exc:
            return exc.code == 401  # a registry that wants a login still answers
        except (OSError, ValueError):
            continue
    return False
