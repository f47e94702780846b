"""Params for tests: the repo's params.yaml with overrides, or seconds-long training runs (tracking off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Params, TrackingConfig, parse_params
from tests.helpers import REPO


def make_params(root: Path, tracking: bool = False, **data: object) -> Params:
    """Params for a test run: the repo's params.yaml on the demo source (a synthetic or real GTSRB at `root`, as the
    tests' data is whatever a project chose) with overrides applied."""
    import yaml

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["data"].update({"source": "gtsrb", "root": str(root), "download": False, **data})
    raw["tracking"] = TrackingConfig(enabled=tracking).model_dump()
    return parse_params(raw)


def train_params(**train: Any) -> Params:
    """Params for a seconds-long run of one small network: 2 epochs of 8 steps, a checkpoint every 3 steps,
    tracking off (`augment=False` turns the augment section off). Validation held out (`train_on_val=True` to
    train on it too, the shipped default), so the step counts are the training split's."""
    augment = {"enabled": train.pop("augment")} if "augment" in train else {}
    raw: dict[str, Any] = {
        "model": {"name": "signnet", "width": 8, "members": 1},
        "train": {"epochs": 2, "batch_size": 32, "checkpoint_every": 3, "threads": 1, "train_on_val": False, **train},
        "augment": augment,
        "evaluate": {"min_accuracy": 0.0},
        "tracking": {"enabled": False},
    }
    return parse_params(raw)


def write_params_yaml(path: Path, params: Params) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return path
