"""Releases a team can update between: CHANGELOG.md kept by git-cliff from the commits between version tags, the
newest section naming pyproject.toml's version (`copier update` across tags: tests/test_template.py)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from tests.helpers import REPO
from tests.helpers.project import GIT_IDENTITY

CLIFF = REPO / ".venv" / "bin" / "git-cliff"


def _git(*args: str, cwd: Path) -> None:
    subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **GIT_IDENTITY}, check=True, capture_output=True)


def test_the_changelog_names_the_packages_version_first() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings and headings[0] == version, (headings[:3], version)
    assert len(headings) == len(set(headings)) >= 2


def test_make_changelog_prepends_the_commits_since_the_last_tag_by_area(tmp_path: Path) -> None:
    repo = tmp_path / "project"
    repo.mkdir()
    shutil.copy(REPO / "cliff.toml", repo / "cliff.toml")
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "the first version", cwd=repo)
    _git("tag", "-a", "v0.1.0", "-m", "v0.1.0", cwd=repo)
    (repo / "CHANGELOG.md").write_text("# Changelog\n\n## 0.1.0 (2026-01-01)\n\n- the first version\n")
    for message in ("serve: a route for health", "docs: the route in serving.md", "review: a typo in the route"):
        (repo / "notes.txt").write_text(message)
        _git("add", "-A", cwd=repo)
        _git("commit", "-qm", message, cwd=repo)
    done = subprocess.run(
        [str(CLIFF), "--config", "cliff.toml", "--unreleased", "--tag", "v0.2.0", "--prepend", "CHANGELOG.md"],
        cwd=repo, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (repo / "CHANGELOG.md").read_text()
    assert text.index("## 0.2.0") < text.index("## 0.1.0")  # the new version on top, the old one kept
    new = text[text.index("## 0.2.0") : text.index("## 0.1.0")]
    assert "### Changes\n\n- serve: a route for health" in new
    assert "### Fixes\n\n- review: a typo in the route" in new
    assert "### Documentation\n\n- docs: the route in serving.md" in new
    assert "the first version" not in new


def test_make_changelog_refuses_a_version_that_is_not_semantic() -> None:
    done = subprocess.run(["make", "changelog", "VERSION=next"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "usage: make changelog VERSION=X.Y.Z" in done.stderr
