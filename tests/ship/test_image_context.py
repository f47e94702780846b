"""The release's build context (`pipeline image-context`): with --champion-only it stages only a file whose passed
gate made it the registry's champion, before any wheel is downloaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path


def test_a_file_that_did_not_become_the_champion_is_not_released(benchmarked_project: Path, tmp_path: Path) -> None:
    work = tmp_path / "project"
    shutil.copytree(benchmarked_project, work, symlinks=True)
    gate = json.loads((work / "reports/evaluate/gate.json").read_text())
    assert gate["passed"] and not gate["promoted_version"]  # the tiny project has no registry: nothing promoted
    assert "tracking.enabled false" in gate["not_promoted"]
    staged = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "image-context", str(tmp_path / "context"), "--champion-only"],
        cwd=work, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert staged.returncode == 2, staged.stderr
    assert "passed its gate but did not become the champion" in staged.stderr
    assert "the release ships only the champion's file" in staged.stderr
    assert not (tmp_path / "context").exists()
