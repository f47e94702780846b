"""Port clashes: a taken port is one clear line naming the port and the setting, for every service."""

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pipeline.errors import StageError
from pipeline.machine.ports import ensure_free, free_port
from tests.helpers import REPO


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield int(listener.getsockname()[1])


def test_a_taken_port_names_itself_and_its_setting(taken_port: int) -> None:
    with pytest.raises(StageError, match=rf"port {taken_port} on 127\.0\.0\.1 is already in use \(set by serve\.port"):
        ensure_free("127.0.0.1", taken_port, "serve.port")
    ensure_free("127.0.0.1", free_port(), "serve.port")
    ensure_free("127.0.0.1", 0, "deploy.host_port")  # 0 = any free port


def test_pipeline_serve_on_a_taken_port_fails_in_one_line(taken_port: int, tmp_path: Path) -> None:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["serve"]["port"] = taken_port
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "serve"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"port {taken_port}" in lines[0] and "serve.port" in lines[0], result.stderr


def test_make_mlflow_ui_on_a_taken_port_names_the_variable(taken_port: int) -> None:
    """The Makefile's check, as `make mlflow-ui MLFLOW_UI_PORT=...` runs it."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.machine.ports", "127.0.0.1", str(taken_port), "MLFLOW_UI_PORT"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "MLFLOW_UI_PORT" in result.stderr and str(taken_port) in result.stderr
    makefile = (REPO / "Makefile").read_text()
    assert "python -m pipeline.machine.ports 127.0.0.1 $(MLFLOW_UI_PORT) MLFLOW_UI_PORT" in makefile


def test_default_ports_do_not_collide() -> None:
    import re

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    mlflow_ui = int(re.search(r"MLFLOW_UI_PORT \?= (\d+)", (REPO / "Makefile").read_text()).group(1))
    # a local registry's port (a project made from the template may push to a remote one: ghcr.io/OWNER, no port here)
    local = re.fullmatch(r"(?:127\.0\.0\.1|localhost):(\d+)", params["deploy"]["registry"])
    ports = [params["serve"]["port"], mlflow_ui, *([int(local.group(1))] if local else [])]
    assert len(set(ports)) == len(ports) and (local or "127.0.0.1" not in params["deploy"]["registry"])


def test_registry_up_on_a_taken_port_says_so(taken_port: int) -> None:
    result = subprocess.run(
        ["bash", str(REPO / "docker/registry-up.sh"), f"127.0.0.1:{taken_port}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and f"port {taken_port}" in result.stderr and "deploy.registry" in result.stderr
