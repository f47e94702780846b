"""The real `dvc repro` on a copy of the project: caching, and re-running when a param changes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.gtsrb import write_synthetic_gtsrb

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh git + DVC copy of the project, with the real sample if configured, else synthetic data."""
    work = tmp_path / "project"
    work.mkdir()
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(REPO / name, work / name)
    shutil.copytree(REPO / "pipeline", work / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    root = os.environ.get("GTSRB_ROOT") or str(write_synthetic_gtsrb(tmp_path / "raw"))
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, GTSRB_ROOT=root, PATH=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    env.pop("MLFLOW_TRACKING_URI", None)
    _run(["git", "init", "-q"], work, env)
    _run([sys.executable, "-m", "dvc", "init", "-q"], work, env)
    return work, env


def test_repro_prepare_caches_and_reruns_on_param_change(project: tuple[Path, dict[str, str]]) -> None:
    work, env = project
    dvc = [sys.executable, "-m", "dvc"]
    first = _run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" in first
    assert (work / "data/prepared/train.npz").is_file()

    second = _run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" not in second
    assert "didn't change" in second

    params = yaml.safe_load((work / "params.yaml").read_text())
    params["data"]["image_size"] = 24
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    status = _run([*dvc, "status", "prepare"], work, env)
    assert "modified" in status and "data" in status  # dvc.yaml tracks the whole data section
    third = _run([*dvc, "repro", "prepare"], work, env)
    assert "Running stage 'prepare'" in third
    import numpy as np

    with np.load(work / "data/prepared/test.npz") as npz:
        assert npz["images"].shape[1:] == (24, 24, 3)
    metrics = _run([*dvc, "metrics", "show"], work, env)
    assert "test_images" in metrics


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="needs the project's git checkout")
def test_every_dvc_output_is_git_ignored_and_the_folders_exist() -> None:
    """Data, weights and reports never reach git: every path dvc.yaml writes is ignored, except the stages'
    small metrics files (DVC experiments carry them, so `dvc exp show` compares runs), while data/ and models/
    themselves (with their READMEs) are part of the checkout."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outputs: set[str] = set()
    for stage in stages.values():
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                outputs.add(next(iter(entry)) if isinstance(entry, dict) else entry)
    assert {"data/prepared", "models/model.pt", "models/variants"} <= outputs
    probe = subprocess.run(
        ["git", "check-ignore", "--no-index", *sorted(outputs)], cwd=REPO, capture_output=True, text=True
    )
    metrics = {path for path in outputs if path.startswith("reports/") and path.endswith("/metrics.json")}
    assert len(metrics) == 7
    assert set(probe.stdout.split()) == outputs - metrics
    tracked = subprocess.run(["git", "ls-files", "data", "models"], cwd=REPO, capture_output=True, text=True)
    assert tracked.stdout.split() == ["data/README.md", "models/README.md"]
