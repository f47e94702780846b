"""`python -m benchmarks models`: the params each network's workspace gets (the runs themselves are the docs' figures)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from benchmarks import models
from pipeline.config import load_params

REPO = Path(__file__).resolve().parents[2]


def _configured(tmp_path: Path, *extra: str) -> dict:
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    parsed = models.parser().parse_args(
        [str(tmp_path / "photos"), "--model", "torchvision/mobilenet_v3_small", "--size", "224", *extra]
    )
    models.configure(tmp_path, parsed, "torchvision/mobilenet_v3_small")
    load_params(tmp_path / "params.yaml")  # what the stages will accept
    return yaml.safe_load((tmp_path / "params.yaml").read_text())


def test_prune_amount_reaches_optimize_and_defaults_to_params(tmp_path: Path) -> None:
    default = yaml.safe_load((REPO / "params.yaml").read_text())["optimize"]["prune_amount"]
    params = _configured(tmp_path, "--finetune-epochs", "3")
    assert params["optimize"]["prune_amount"] == default and params["optimize"]["finetune_epochs"] == 3
    params = _configured(tmp_path, "--prune-amount", "0.25")
    assert params["optimize"]["prune_amount"] == 0.25
    assert params["model"]["name"] == "torchvision/mobilenet_v3_small" and params["data"]["image_size"] == 224
