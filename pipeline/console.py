"""Progress and log lines: rich progress bars on a terminal, plain lines in CI and logs."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator
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
