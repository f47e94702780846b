"""Progress: k of n with elapsed time and an ETA, one line per step in logs; a spinner only on a terminal."""

import os
import pty
import subprocess
import sys

import pytest

from pipeline import console
from pipeline.ship.docker_engine import build_progress, stream
from tests.helpers import REPO

STEPS_SCRIPT = """
import time
from pipeline.console import Steps
steps = Steps("benchmark", 2)
for label in ("first setup", "second setup"):
    with steps.running(label):
        time.sleep(0.3)
    steps.finished(label, "1,234 img/s")
"""


def test_steps_log_k_of_n_elapsed_and_eta(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    steps = console.Steps("benchmark", 3)
    for label in ("a", "b", "c"):
        with steps.running(label):
            pass
        steps.finished(label, "ok")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert "benchmark [1/3] a: ok (0s elapsed, about 0s left)" in lines[0]
    assert lines[2].endswith("benchmark [3/3] c: ok (0s elapsed)")


def _run(stderr_to_tty: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | {"PYTHONPATH": str(REPO), "TERM": "xterm"}
    if not stderr_to_tty:
        result = subprocess.run([sys.executable, "-c", STEPS_SCRIPT], env=env, capture_output=True, timeout=60)
        return result.stderr.decode()
    leader, follower = pty.openpty()
    process = subprocess.Popen([sys.executable, "-c", STEPS_SCRIPT], env=env, stderr=follower, stdout=follower)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    process.wait(timeout=60)
    os.close(leader)
    return b"".join(chunks).decode(errors="replace")


def test_a_spinner_on_a_terminal_plain_lines_otherwise() -> None:
    terminal = _run(stderr_to_tty=True)
    assert "benchmark [1/2] first setup ..." in terminal  # the running step, shown while it runs
    assert "benchmark [2/2] second setup: 1,234 img/s" in terminal
    piped = _run(stderr_to_tty=False)
    assert "\r" not in piped and "\x1b[" not in piped  # no carriage-return spam, no escape codes in CI logs
    assert piped.count("\n") == 2 and "[1/2] first setup: 1,234 img/s" in piped and "about" in piped


def test_ticker_speaks_at_most_every_interval(capsys: pytest.CaptureFixture[str]) -> None:
    ticker = console.Ticker(every_s=3600)
    for _ in range(100):
        ticker.maybe("waiting")
    assert capsys.readouterr().err == ""
    ticker = console.Ticker(every_s=0)
    ticker.maybe("waiting for ready")
    assert "waiting for ready (0s)" in capsys.readouterr().err


def test_docker_build_output_is_condensed_to_one_line_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    # The classic builder's and BuildKit's plain output, as `docker build` prints them.
    output = """Sending build context to Docker daemon  59.97MB
Step 1/25 : ARG BASE_IMAGE=python:3.11-slim-bookworm
Step 2/25 : FROM ${BASE_IMAGE} AS builder
 ---> b261d81da7ba
 ---> Using cache
Step 5/25 : RUN python3 -m venv /opt/venv  && /opt/venv/bin/pip install --no-index --find-links /wheels --only-binary=:all: -r /wheels/requirements.txt
#7 [builder 3/6] COPY wheels/ /wheels/
#7 DONE 0.4s
#7 [builder 3/6] COPY wheels/ /wheels/
#8 [runtime 2/5] RUN groupadd --system app
#8 0.312 useradd: warning
"""
    on_line = build_progress("containerize: ")
    code, captured = stream([sys.executable, "-c", f"print({output!r}, end='')"], dict(os.environ), 60, on_line)
    assert code == 0 and captured == output
    lines = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert lines[0] == "containerize: Step 1/25 : ARG BASE_IMAGE=python:3.11-slim-bookworm"
    assert lines[2].startswith("containerize: Step 5/25 : RUN python3") and lines[2].endswith("...")
    assert len(lines[2]) <= len("containerize: ") + 120
    assert lines[3:] == [
        "containerize: #7 [builder 3/6] COPY wheels/ /wheels/",
        "containerize: #8 [runtime 2/5] RUN groupadd --system app",
    ]


def test_a_stream_past_its_time_limit_is_killed() -> None:
    code, _ = stream([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), 0.5, lambda line: None)
    assert code is None
