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


def test_the_changelog_keeps_unreleased_notes_above_the_packages_version() -> None:
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert headings[:2] == ["Unreleased", version], (headings[:3], version)
    assert len(headings) == len(set(headings)) >= 3


def test_a_release_writes_the_changelog_and_the_workflow_tags_its_commit(tmp_path: Path) -> None:
    """scripts/changelog.sh (make changelog) turns the Unreleased notes into the version's section from the commits
    since the last tag and sets pyproject's version; the "release: vX.Y.Z" commit is then tagged by
    scripts/release-tag.sh as tag.yml runs it, once (a second run, and a version without its release commit, tag
    nothing)."""
    repo = tmp_path / "project"
    (repo / "scripts").mkdir(parents=True)
    for name in ("cliff.toml", "scripts/changelog.sh", "scripts/release-tag.sh"):
        shutil.copy2(REPO / name, repo / name)
    (repo / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0.1.0"\n')
    _git("init", "-q", "-b", "main", cwd=repo)
    _git("add", "-A", cwd=repo)
    _git("commit", "-qm", "the first version", cwd=repo)
    _git("tag", "-a", "v0.1.0", "-m", "v0.1.0", cwd=repo)
    (repo / "CHANGELOG.md").write_text(
        "# Changelog\n\n## Unreleased\n\n- notes kept by hand\n\n## 0.1.0 (2026-01-01)\n\n- the first version\n"
    )
    for message in ("serve: a route for health", "docs: the route in serving.md", "review: a typo in the route"):
        (repo / "notes.txt").write_text(message)
        _git("add", "-A", cwd=repo)
        _git("commit", "-qm", message, cwd=repo)
    tag = subprocess.run(["scripts/release-tag.sh"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert tag.returncode == 0 and "nothing to tag" in tag.stdout, tag.stderr  # 0.1.0 is tagged already
    done = subprocess.run(
        ["scripts/changelog.sh", "0.2.0"], cwd=repo, capture_output=True, text=True, timeout=60,
        env={**os.environ, "GIT_CLIFF": str(CLIFF)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = (repo / "CHANGELOG.md").read_text()
    assert re.findall(r"^## (\S+)", text, re.M) == ["Unreleased", "0.2.0", "0.1.0"]
    assert "notes kept by hand" not in text  # the version's section says it from the commits
    assert 'version = "0.2.0"' in (repo / "pyproject.toml").read_text()
    new = text[text.index("## 0.2.0") : text.index("## 0.1.0")]
    assert "### Changes\n\n- serve: a route for health" in new
    assert "### Fixes\n\n- review: a typo in the route" in new
    assert "### Documentation\n\n- docs: the route in serving.md" in new
    assert "the first version" not in new

    _git("commit", "-qam", "release: v0.2.0", cwd=repo)
    (repo / "notes.txt").write_text("after the release")
    _git("commit", "-qam", "serve: after the release", cwd=repo)  # the workflow runs on a later push too
    tagged = subprocess.run(["scripts/release-tag.sh"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert tagged.returncode == 0 and "as v0.2.0" in tagged.stdout, tagged.stderr
    release = subprocess.run(["git", "rev-parse", "v0.2.0^{commit}"], cwd=repo, capture_output=True, text=True)
    subject = subprocess.run(["git", "log", "-1", "--format=%s", release.stdout.strip()], cwd=repo,
                             capture_output=True, text=True)  # fmt: skip
    assert subject.stdout.strip() == "release: v0.2.0"
    again = subprocess.run(["scripts/release-tag.sh"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "v0.2.0 exists" in again.stdout
    workflow = (REPO / ".github" / "workflows" / "tag.yml").read_text()
    assert "PUSH=1 scripts/release-tag.sh" in workflow and "fetch-depth: 0" in workflow


def test_make_changelog_refuses_a_version_that_is_not_semantic() -> None:
    done = subprocess.run(["make", "changelog", "VERSION=next"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "usage: make changelog VERSION=X.Y.Z" in done.stderr
