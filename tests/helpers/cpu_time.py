"""The CPU time each test costs (its process and the subprocesses it waited for: stages, servers, `dvc repro`; not
what the Docker engine or act's containers spend), beside its wall time: the suite's budget is CPU on two cores,
and wall time under three workers says little about one test. `make test` prints the tests that cost most;
PYTEST_CPU_TIME_FILE=path writes every test's cost there (tab-separated, costliest first)."""

from __future__ import annotations

import os
import resource
from collections.abc import Generator
from pathlib import Path

import pytest

KEY = "cpu_seconds"
SHOWN = 25
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


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _costs:
        return
    total = sum(cost for cost, _ in _costs)
    terminalreporter.section(f"CPU time per test: {total / 60:.1f} min in all, the {SHOWN} costliest")
    ranked = sorted(_costs, reverse=True)
    for cost, nodeid in ranked[:SHOWN]:
        terminalreporter.write_line(f"{cost:8.1f}s  {100 * cost / total:4.1f}%  {nodeid}")
    if path := os.environ.get("PYTEST_CPU_TIME_FILE"):
        Path(path).write_text("".join(f"{cost:.2f}\t{nodeid}\n" for cost, nodeid in ranked))
