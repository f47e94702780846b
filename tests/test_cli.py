"""The `pipeline` command as a user runs it: a separate process, exit codes, one-line errors."""

import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import REPO
from tests.helpers.images import SyntheticImages
from tests.helpers.params import on_test_data


def pipeline(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_help_lists_every_stage(tmp_path: Path) -> None:
    result = pipeline("--help", cwd=tmp_path)
    assert result.returncode == 0
    for stage in ("prepare", "train", "evaluate", "optimize", "benchmark", "containerize", "deploy", "serve"):
        assert stage in result.stdout


def test_bad_param_is_one_line_without_traceback(tmp_path: Path) -> None:
    text = re.sub(r"^  image_size: ~ .*", "  image_size: big", (REPO / "params.yaml").read_text(), flags=re.M)
    (tmp_path / "params.yaml").write_text(text)
    result = pipeline("prepare", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: params.yaml: data.image_size: input should be a valid integer, got 'big'")
    assert not (tmp_path / "data").exists()


def test_typo_in_key_names_it(tmp_path: Path) -> None:
    (tmp_path / "p.yaml").write_text("data:\n  imagesize: 32\n")
    result = pipeline("prepare", "--params", "p.yaml", cwd=tmp_path)
    assert result.returncode == 2 and "data.imagesize: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_prepare_runs_through_the_cli(synthetic_images: SyntheticImages, tmp_path: Path) -> None:
    raw = on_test_data(yaml.safe_load((REPO / "params.yaml").read_text()), synthetic_images.folder)
    raw["tracking"]["enabled"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    result = pipeline("prepare", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data/prepared/manifest.json").is_file()
    assert "train" in result.stderr and "0 unreadable" in result.stderr


def test_missing_data_is_one_line_that_names_it(tmp_path: Path) -> None:
    raw = on_test_data(yaml.safe_load((REPO / "params.yaml").read_text()), "data/raw")
    raw["tracking"]["enabled"] = False
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    result = pipeline("prepare", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.root data/raw is not a folder" in result.stderr
