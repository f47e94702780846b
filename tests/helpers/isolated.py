"""Run a client library in a fresh interpreter. KServe's generated gRPC messages and tritonclient.grpc's share
protobuf names (`inference.*`), so once one is imported in a process the other cannot be: tests that use KServe's
clients run them here and get JSON back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any


def run_isolated(code: str, timeout_s: float = 120) -> Any:
    """Run `code` (dedented) in a new Python; it must print one JSON value as its last line of output."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
