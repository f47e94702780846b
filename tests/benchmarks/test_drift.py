"""`python -m benchmarks drift`: runs to the end, both paths measured, the several-workers one on file-backed values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_drift_times_both_paths_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "drift", "--repeats", "1", "--calls", "50", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    setups = {r["setup"] for r in rows}
    assert setups == {"one worker (custom collector)", "several workers"}  # file-backed: no "(in-memory ...)"
    assert {(r["images"], r["size"]) for r in rows} == {(1, 32), (8, 32), (1, 224), (8, 224)}
    assert all(r["us_per_request"] > 0 for r in rows)
    assert "µs / request" in done.stdout
