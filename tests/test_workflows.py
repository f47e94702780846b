"""The GitHub Actions workflows and Dependabot config validate against their published schemas
(vendored by check-jsonschema, so this runs offline), and third-party actions are pinned to commits."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))


def _check(schema: str, files: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, *map(str, files)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_workflows_match_the_github_schema() -> None:
    assert WORKFLOWS, "no workflow files"
    result = _check("vendor.github-workflows", WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dependabot_matches_its_schema() -> None:
    result = _check("vendor.dependabot", [REPO / ".github" / "dependabot.yml"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_schema_check_rejects_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  build:\n    runs-on: ubuntu-latest\n    steps: not-a-list\n")
    assert _check("vendor.github-workflows", [broken]).returncode != 0


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_actions_are_pinned_and_permissions_explicit(workflow: Path) -> None:
    text = workflow.read_text()
    for ref in re.findall(r"uses:\s*([^\s#]+)", text):
        if ref.startswith("./"):
            continue
        assert re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", ref), f"{workflow.name}: {ref} is not pinned to a commit"
    assert "permissions" in yaml.safe_load(text), f"{workflow.name}: no top-level permissions"
