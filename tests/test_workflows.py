"""The GitHub Actions workflows and Dependabot config validate against their published schemas
(vendored by check-jsonschema, so this runs offline), and third-party actions are pinned to commits."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import DATA_ROOT_ENVS, REPO

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


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=lambda p: p.name)
def test_jobs_have_timeouts_and_runs_cancel_or_queue(workflow: Path) -> None:
    doc = yaml.safe_load(workflow.read_text())
    assert "concurrency" in doc, f"{workflow.name}: no concurrency group"
    for name, job in doc["jobs"].items():
        assert "timeout-minutes" in job, f"{workflow.name}: job {name} has no timeout-minutes"
        for scope, level in (job.get("permissions") or {}).items():
            assert level in ("read", "write", "none"), f"{workflow.name}: {name}: {scope}: {level}"
    # Least privilege: nothing is writable for the whole workflow, only per job.
    assert all(level != "write" for level in (doc["permissions"] or {}).values()), workflow.name


def _remote_actions(workflow: Path) -> set[str]:
    refs = re.findall(r"uses:\s*([^\s#]+)", workflow.read_text())
    return {ref.split("@")[0] for ref in refs if not ref.startswith(("./", "docker://"))}


@pytest.mark.parametrize("name", ["ci", "pipeline"])
def test_act_has_a_local_stand_in_for_every_remote_action(name: str) -> None:
    """scripts/act.sh maps each remote action to .github/act/<owner>/<repo>[/path]: act runs offline."""
    for action in _remote_actions(REPO / ".github" / "workflows" / f"{name}.yml") - {"actions/checkout"}:
        stand_in = REPO / ".github" / "act" / action / "action.yml"
        assert stand_in.is_file(), f"{name}.yml uses {action}: add {stand_in.relative_to(REPO)}"
        assert yaml.safe_load(stand_in.read_text())["runs"]["using"] == "composite"


def test_act_stand_ins_match_the_github_action_schema() -> None:
    stand_ins = sorted((REPO / ".github" / "act").rglob("action.yml"))
    assert stand_ins
    result = _check("vendor.github-actions", stand_ins)
    assert result.returncode == 0, result.stdout + result.stderr


def test_act_script_maps_every_action_of_the_workflow(tmp_path: Path) -> None:
    """Run scripts/act.sh with a fake act that prints its arguments: the mappings come from the workflow file."""
    fake = tmp_path / "act"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in __import__("os").environ.items() if k not in DATA_ROOT_ENVS}
    result = subprocess.run(
        [str(REPO / "scripts" / "act.sh"), "pipeline", "--input", "quick=true"],
        capture_output=True, text=True, timeout=60, env={**env, "ACT_BIN": str(fake), "ACT_OUTPUT_DIR": str(tmp_path / "out")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    args = result.stdout.splitlines()
    mapped = {args[i + 1].split("@")[0] for i, a in enumerate(args) if a == "--local-repository"}
    assert mapped == {
        a.split("/")[0] + "/" + a.split("/")[1] for a in _remote_actions(REPO / ".github/workflows/pipeline.yml")
    } - {"actions/checkout"}
    for i, a in enumerate(args):
        if a == "--local-repository":
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}=/\S+/\.github/act/[\w.-]+/[\w.-]+", args[i + 1])
    assert "ubuntu-latest=-self-hosted" in args and "ubuntu-24.04-arm=-self-hosted" in args
    assert args[0] == "workflow_dispatch" and args[-2:] == ["--input", "quick=true"]
    assert f"ACT_ARTIFACT_DIR={tmp_path / 'out' / 'pipeline'}" in args
    assert (tmp_path / "out" / "pipeline.log").is_file()


def test_the_pipeline_runs_on_an_x86_and_an_arm_runner_and_the_compare_job_reads_both() -> None:
    """What the act run of pipeline.yml (one leg: both map to this host) cannot show: GitHub runs two legs, on an
    x86 and an Arm runner, and the compare job merges the report of each one the matrix names."""
    doc = yaml.safe_load((REPO / ".github" / "workflows" / "pipeline.yml").read_text())
    legs = {leg["arch"]: leg["runner"] for leg in doc["jobs"]["repro"]["strategy"]["matrix"]["include"]}
    assert legs == {"x86_64": "ubuntu-latest", "arm64": "ubuntu-24.04-arm"}
    compare = doc["jobs"]["compare"]
    assert compare["needs"] == "repro"
    merge = next(step["run"] for step in compare["steps"] if step.get("name") == "Merge the benchmark reports")
    assert f"for arch in {' '.join(legs)}; do" in merge
    uploads = [
        step for step in doc["jobs"]["repro"]["steps"] if step.get("uses", "").startswith("actions/upload-artifact")
    ]
    assert "pipeline-${{ matrix.arch }}" in {step["with"]["name"] for step in uploads}


def test_exactly_one_leg_promotes_and_the_release_ships_that_legs_champion() -> None:
    """Both legs gate their model, but only the x86 one may move `champion` (evaluate.promote, set per leg on the
    experiment): the release builds from that leg's artifact, and only a file that became the champion."""
    doc = yaml.safe_load((REPO / ".github" / "workflows" / "pipeline.yml").read_text())
    legs = {leg["arch"]: leg["promote"] for leg in doc["jobs"]["repro"]["strategy"]["matrix"]["include"]}
    assert legs == {"x86_64": "auto", "arm64": "never"}
    prepare = next(s["run"] for s in doc["jobs"]["repro"]["steps"] if s.get("name", "").startswith("prepare"))
    assert 'settings+=(-S "evaluate.promote=${{ matrix.promote }}")' in prepare
    release = yaml.safe_load((REPO / ".github" / "workflows" / "release.yml").read_text())
    steps = release["jobs"]["build"]["steps"]
    promoting = next(arch for arch, policy in legs.items() if policy == "auto")
    assert any(s.get("with", {}).get("name") == f"pipeline-{promoting}" for s in steps)
    context = next(s["run"] for s in steps if s.get("id") == "context")
    assert "--champion-only" in context
