"""The Docker engine, through its CLI: is one reachable, build, inspect, run, stop, push, pull."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.console import Ticker, log
from pipeline.errors import StageError

ENGINE_HINT = (
    "start one (`docker/engine-up.sh` installs and starts Debian's engine as root), point DOCKER_HOST at "
    "one, or skip this stage without an engine with `{param}: true` in params.yaml"
)


def skips_without_engine(setting: bool | str, env: Mapping[str, str] | None = None) -> bool:
    """Whether a stage records a skip when no engine answers: `true`; `auto` everywhere but CI (`CI=true`), where
    a missing engine must fail the run rather than ship nothing quietly."""
    env = os.environ if env is None else env
    return setting is True or (setting == "auto" and env.get("CI", "").lower() != "true")


class NoEngine(StageError):
    """No Docker engine answers: the message says why and what to do."""


class DockerError(StageError):
    """A docker command failed: the message carries the command and the end of its output."""


@dataclass(frozen=True)
class DockerEngine:
    cli: str
    server_version: str
    os_arch: str  # e.g. linux/amd64

    @property
    def native_platform(self) -> str:
        return self.os_arch


def _arch_name(machine: str) -> str:
    return {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(machine.lower(), machine)


def find_engine(param: str = "skip_without_engine", timeout_s: float = 15.0) -> DockerEngine:
    """The engine the docker CLI reaches, or NoEngine with one clear sentence."""
    cli = shutil.which("docker")
    if cli is None:
        raise NoEngine(f"no Docker engine: the `docker` command is not installed; {ENGINE_HINT.format(param=param)}")
    try:
        proc = subprocess.run(
            [cli, "version", "--format", "{{json .Server}}"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise NoEngine(
            f"no Docker engine: `docker version` did not answer in {timeout_s:.0f} s; {ENGINE_HINT.format(param=param)}"
        ) from None
    server: dict[str, Any] | None = None
    if proc.returncode == 0 and proc.stdout.strip() not in ("", "null"):
        try:
            server = json.loads(proc.stdout)
        except ValueError:
            server = None
    if not server:
        reason = (proc.stderr.strip().splitlines() or ["the engine did not answer"])[-1]
        raise NoEngine(f"no Docker engine reachable ({reason}); {ENGINE_HINT.format(param=param)}")
    arch = _arch_name(str(server.get("Arch") or platform.machine()))
    return DockerEngine(
        cli=cli, server_version=str(server.get("Version", "?")), os_arch=f"{server.get('Os', 'linux')}/{arch}"
    )


def docker(
    engine: DockerEngine,
    args: Sequence[str],
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    check: bool = True,
    input_text: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `docker ARGS`; on failure raise DockerError with the command and the last lines of its output."""
    full_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run(
            [engine.cli, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=full_env,
            check=False,
            input=input_text,
        )
    except subprocess.TimeoutExpired:
        raise DockerError(f"`docker {' '.join(args[:3])} ...` did not finish within {timeout_s:.0f} s") from None
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-15:])
        raise DockerError(f"`docker {' '.join(args[:4])} ...` failed (exit {proc.returncode}):\n{tail}")
    return proc


def image_exists(engine: DockerEngine, ref: str) -> bool:
    return docker(engine, ["image", "inspect", ref], check=False, timeout_s=60).returncode == 0


def inspect_image(engine: DockerEngine, ref: str) -> dict[str, Any]:
    out = docker(engine, ["image", "inspect", ref], timeout_s=60).stdout
    data = json.loads(out)
    return dict(data[0])


def ensure_base_image(engine: DockerEngine, base: str, arch: str, log_prefix: str) -> None:
    """A `local/...` base missing from the engine is built here with docker/base-image.sh (debootstrap from the
    Debian mirror: no registry of base images needed); any other base is left for the build to pull."""
    if image_exists(engine, base) or not base.startswith("local/"):
        return
    from pipeline.console import log

    script = Path(__file__).resolve().parents[2] / "docker" / "base-image.sh"
    log(f"{log_prefix}building the base image {base} ({arch}) with {script.name} (debootstrap, minutes)")
    proc = subprocess.run(["bash", str(script), base, arch], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise StageError(f"building the base image {base} failed:\n{(proc.stdout + proc.stderr).strip()[-1500:]}")


def build(
    engine: DockerEngine,
    context: Path,
    dockerfile: Path,
    tags: Sequence[str],
    build_args: dict[str, str],
    *,
    platform_name: str | None = None,
    buildkit: bool = False,
    log_path: Path | None = None,
    timeout_s: float = 3600.0,
    progress_prefix: str = "containerize: ",
) -> float:
    """`docker build`; returns the wall time in seconds. One line per build step as it starts; the full build
    log goes to `log_path`."""
    args = ["build", "-f", str(dockerfile)]
    for tag in tags:
        args += ["-t", tag]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    if platform_name:
        args += ["--platform", platform_name]
    args.append(str(context))
    cli = engine.cli
    env = {"DOCKER_BUILDKIT": "1" if buildkit else "0"}
    if buildkit and Path("/usr/bin/docker").exists():
        # The preinstalled newer CLI wants buildx for BuildKit; Debian's own CLI drives the engine's BuildKit.
        cli = "/usr/bin/docker"
    started = time.perf_counter()
    returncode, output = stream([cli, *args], {**os.environ, **env}, timeout_s, build_progress(progress_prefix))
    seconds = time.perf_counter() - started
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(output)
    if returncode is None:
        raise DockerError(f"docker build did not finish within {timeout_s:.0f} s")
    if returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-20:])
        where = f" (full log: {log_path})" if log_path else ""
        raise DockerError(f"docker build failed (exit {returncode}){where}:\n{tail}")
    return seconds


def stream(
    command: Sequence[str], env: dict[str, str], timeout_s: float, on_line: Callable[[str], None]
) -> tuple[int | None, str]:
    """Run `command`, handing each output line (stdout and stderr merged) to `on_line` as it comes; returns the
    exit code (None when it ran past `timeout_s` and was killed) and the whole output."""
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, errors="replace"
    )
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            on_line(line.rstrip("\n"))
        returncode = proc.wait()
    finally:
        expired = not timer.is_alive()
        timer.cancel()
    return (None if expired and returncode < 0 else returncode), "".join(lines)


# The engine's own progress, condensed to one line per build step: the classic builder's "Step 3/12 : RUN ...",
# BuildKit's plain "#7 [builder 3/6] RUN ..." (its first line per step; the rest of the output goes to the log).
_BUILD_STEP = re.compile(r"^(Step \d+/\d+ : .*|#(\d+) \[[^\]]+\] .*)$")


def build_progress(prefix: str) -> Callable[[str], None]:
    seen: set[str] = set()

    def on_line(line: str) -> None:
        match = _BUILD_STEP.match(line)
        if match is None or (match.group(2) is not None and match.group(2) in seen):
            return
        if match.group(2) is not None:
            seen.add(match.group(2))
        text = match.group(1)
        log(f"{prefix}{text[:117] + '...' if len(text) > 120 else text}")

    return on_line


def image_platform(info: dict[str, Any]) -> str:
    arch = str(info.get("Architecture", "?"))
    return f"{info.get('Os', 'linux')}/{arch}"


def wait_ready(url: str, timeout_s: float, container: str | None = None, engine: DockerEngine | None = None) -> float:
    """Poll `url` until it answers 200; returns the seconds it took. Fails early when the container exits."""
    import urllib.error
    import urllib.request

    started = time.perf_counter()
    deadline = started + timeout_s
    last = "no answer"
    ticker = Ticker(every_s=10.0)
    while time.perf_counter() < deadline:
        ticker.maybe(f"deploy: waiting for {url} to be ready (of {timeout_s:.0f} s allowed; last: {last})")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.perf_counter() - started
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            last = str(exc)
        if container and engine:
            state = docker(engine, ["inspect", "-f", "{{.State.Status}}", container], check=False, timeout_s=30)
            if state.returncode != 0 or state.stdout.strip() in ("exited", "dead"):
                logs = docker(engine, ["logs", "--tail", "20", container], check=False, timeout_s=30)
                raise StageError(
                    f"container {container} stopped before it was ready:\n{(logs.stdout + logs.stderr).strip()}"
                )
        time.sleep(0.2)
    raise StageError(f"{url} was not ready within {timeout_s:.0f} s (last: {last})")
