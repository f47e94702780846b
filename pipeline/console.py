"""Progress and log lines: rich progress bars on a terminal, plain lines in CI and logs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def interactive() -> bool:
    return sys.stderr.isatty() and not os.environ.get("CI")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def progress(items: Iterable[T], total: int, description: str) -> Iterator[T]:
    """Iterate with a progress bar on a TTY, or a log line every 10% otherwise."""
    if interactive():
        from rich.progress import track

        yield from track(items, total=total, description=description, console=None, transient=True)
        return
    step = max(1, total // 10)
    for done, item in enumerate(items, 1):
        yield item
        if done % step == 0 or done == total:
            log(f"{description}: {done}/{total}")


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Steps:
    """`total` steps of one job, each with its own line when it finishes: k of n, the elapsed time and an ETA
    from the mean so far. On a terminal a transient spinner names the running step; in CI and logs only the
    lines (no carriage returns)."""

    def __init__(self, job: str, total: int) -> None:
        self.job, self.total, self.done = job, total, 0
        self.began = time.perf_counter()

    @contextmanager
    def running(self, label: str) -> Iterator[None]:
        if not interactive():
            yield
            return
        from rich.console import Console

        with Console(stderr=True).status(f"{self.job} [{self.done + 1}/{self.total}] {label} ..."):
            yield

    def finished(self, label: str, summary: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.began
        left = self.total - self.done
        eta = f", about {_duration(elapsed / self.done * left)} left" if left else ""
        log(f"{self.job} [{self.done}/{self.total}] {label}: {summary} ({_duration(elapsed)} elapsed{eta})")


class Ticker:
    """A line at most every `every_s` seconds while something is waited for (a readiness probe, a push)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.began = self.last = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def maybe(self, message: str) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            log(f"{message} ({_duration(now - self.began)})")
