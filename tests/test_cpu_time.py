"""The suite's CPU accounting (tests/helpers/cpu_time.py): PYTEST_PROCESS_LOG logs every Python process a run starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.cpu_time import command_kind, process_costs


def test_the_process_log_holds_every_python_process_of_a_run_and_sums_them_by_command(tmp_path: Path) -> None:
    (tmp_path / "test_spends.py").write_text(
        "import subprocess, sys\n"
        "def test_spends():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(3_000_000))', 'spender'], check=True)\n"
    )  # fmt: skip
    log = tmp_path / "processes.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS", "PYTHONPATH")}
    env |= {"PYTEST_PROCESS_LOG": str(log), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.helpers.cpu_time", "-p", "no:cacheprovider",
         str(tmp_path / "test_spends.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in log.read_text().splitlines()]
    spender = [r for r in records if r["argv"][-1:] == ["spender"]]
    assert len(spender) == 1 and spender[0]["cpu_s"] > 0, records
    assert spender[0]["test"].endswith("test_spends.py::test_spends")
    assert "CPU time per command" in done.stdout and "-c spender" not in done.stdout  # the command, not its args
    assert any(kind == "-c" and count >= 1 for _, count, kind in process_costs(log))


def test_a_command_is_its_program_and_subcommand() -> None:
    assert command_kind(["/venv/bin/pipeline", "train", "-p", "params.yaml"]) == "pipeline train"
    assert command_kind(["/venv/lib/python3.11/site-packages/dvc/__main__.py", "repro", "card"]) == "dvc repro"
    assert command_kind(["-c", "from multiprocessing.spawn import spawn_main"]) == "-c"
    assert command_kind(["/repo/pipeline/stages/benchmark.py", '{"variant": "fp32"}']) == "stages/benchmark.py"
    assert command_kind(["/repo/pipeline/cli.py", "serve", "--port", "8000"]) == "pipeline/cli.py serve"
    assert command_kind([]) == "?"


def test_every_run_ends_with_its_minutes_against_the_budget() -> None:
    from tests.helpers.cpu_time import budget_line

    assert (
        budget_line(22 * 60, 31 * 60) == "budget: pytest 22.0 min of 25, CPU counted per test 31.0 min of 40: within it"
    )
    assert budget_line(26 * 60, 41 * 60).endswith("OVER on pytest and CPU")
    assert budget_line(10 * 60, 45 * 60).endswith("OVER on CPU")
