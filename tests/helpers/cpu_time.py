"""The CPU time each test costs (its process and the subprocesses it waited for: stages, servers, `dvc repro`; not
what the Docker engine or act's containers spend), beside its wall time: the suite's budget is CPU on two cores,
and wall time under three workers says little about one test. `make test` prints the tests that cost most;
PYTEST_CPU_TIME_FILE=path writes every test's cost there (tab-separated, costliest first).

PYTEST_PROCESS_LOG=path: every Python process the run starts (workers, stages, servers, `dvc`, act's host jobs, a
queue's detached workers: all but the Docker engine's containers) appends its command, CPU and wall time and its test
to that file at exit, through a `sitecustomize` put first on PYTHONPATH; the summary adds the costliest commands."""

from __future__ import annotations

import json
import os
import resource
import time
from collections import Counter
from collections.abc import Generator
from pathlib import Path

import pytest

KEY = "cpu_seconds"
SHOWN = 25
# The suite's budget on the 2-core machine (docs/ci.md): minutes of pytest, and CPU minutes counted per test.
BUDGET_WALL_MIN, BUDGET_CPU_MIN = 25, 40
_started = pytest.StashKey[float]()
_costs: list[tuple[float, str]] = []  # (CPU seconds, test id), gathered where the terminal summary is printed


def _cpu() -> float:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    item.stash[_started] = _cpu()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, None]:
    outcome = yield
    if call.when == "teardown":  # the last phase: setup + call + teardown
        report = outcome.get_result()  # type: ignore[attr-defined]
        report.user_properties.append((KEY, _cpu() - item.stash[_started]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """On the controller too: workers send their reports with these properties."""
    for key, value in report.user_properties:
        if key == KEY and report.when == "teardown":
            _costs.append((float(value), report.nodeid))


PROCESS_LOG_ENV = "PYTEST_PROCESS_LOG"
_PROCESS_LOGGER = """import atexit, json, os, resource, sys, time

_started = time.time()


def _write_process_record():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"argv": sys.argv[:6], "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
              "wall_s": round(time.time() - _started, 2),
              "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    try:
        with open(os.environ["PYTEST_PROCESS_LOG"], "a") as log:
            log.write(json.dumps(record) + "\\n")
    except (KeyError, OSError):
        pass


atexit.register(_write_process_record)
"""


def pytest_configure(config: pytest.Config) -> None:
    """With PYTEST_PROCESS_LOG, the logger goes first on PYTHONPATH before any worker or subprocess starts."""
    path = os.environ.get(PROCESS_LOG_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    log = Path(path).resolve()
    os.environ[PROCESS_LOG_ENV] = str(log)
    site = log.parent / f".{log.name}.site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(_PROCESS_LOGGER)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def command_kind(argv: list[str]) -> str:
    """A process's command for the summary: the program, and its subcommand when it has one."""
    if not argv:
        return "?"
    if argv[0] == "-c":  # inline code (xdist's workers, multiprocessing's children): its arguments are not commands
        return "-c"
    path = Path(argv[0])
    program = path.name
    if program == "__main__.py":  # `python -m package`
        program = path.parent.name
    elif program.endswith(".py"):  # `python -m package.module` or a script: with its folder
        program = f"{path.parent.name}/{program}"
    sub = [a for a in argv[1:2] if a and not a.startswith(("-", "/", "{", "[")) and len(a) < 40]
    return " ".join([program, *sub])


def process_costs(path: Path) -> list[tuple[float, int, str]]:
    """(CPU seconds, processes, command) from a PYTEST_PROCESS_LOG file, costliest first."""
    cpu: Counter[str] = Counter()
    processes: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a killed process
            continue
        kind = command_kind(record["argv"])
        cpu[kind] += record["cpu_s"]
        processes[kind] += 1
    return sorted(((seconds, processes[kind], kind) for kind, seconds in cpu.items()), reverse=True)


_session_started = time.monotonic()


def budget_line(wall_s: float, cpu_s: float) -> str:
    """The run against the suite's budget, the last line of every run's summary."""
    wall, cpu = wall_s / 60, cpu_s / 60
    over = [what for what, spent, limit in (("pytest", wall, BUDGET_WALL_MIN), ("CPU", cpu, BUDGET_CPU_MIN))
            if spent > limit]  # fmt: skip
    verdict = f"OVER on {' and '.join(over)}" if over else "within it"
    return (
        f"budget: pytest {wall:.1f} min of {BUDGET_WALL_MIN}, CPU counted per test {cpu:.1f} min of "
        f"{BUDGET_CPU_MIN}: {verdict}"
    )


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    log = os.environ.get(PROCESS_LOG_ENV)
    if log and not os.environ.get("PYTEST_XDIST_WORKER") and Path(log).is_file():
        costs = process_costs(Path(log))
        terminalreporter.section(
            f"CPU time per command: {sum(c for c, _, _ in costs) / 60:.1f} min in Python processes ({log})"
        )
        for cpu, count, kind in costs[:SHOWN]:
            terminalreporter.write_line(f"{cpu:8.1f}s  {count:5d} processes  {kind}")
    if not _costs:
        return
    total = sum(cost for cost, _ in _costs)
    terminalreporter.section(f"CPU time per test: {total / 60:.1f} min in all, the {SHOWN} costliest")
    ranked = sorted(_costs, reverse=True)
    for cost, nodeid in ranked[:SHOWN]:
        terminalreporter.write_line(f"{cost:8.1f}s  {100 * cost / total:4.1f}%  {nodeid}")
    if path := os.environ.get("PYTEST_CPU_TIME_FILE"):
        Path(path).write_text("".join(f"{cost:.2f}\t{nodeid}\n" for cost, nodeid in ranked))
    terminalreporter.section("the suite's budget (docs/ci.md)")
    terminalreporter.write_line(budget_line(time.monotonic() - _session_started, total))
