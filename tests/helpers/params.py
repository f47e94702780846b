"""Params for tests: the repo's params.yaml on the tests' synthetic images (or the data given), or seconds-long
training runs (tracking off)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import NAMED_KEYS, Params, TrackingConfig, parse_params
from tests.helpers import REPO

TEST_RECIPE = REPO / "tests" / "helpers" / "recipe.yaml"
SYNTHETIC_NAME = "signs"  # the run's name on the tests' images, whatever names the project's params.yaml gives


def on_test_data(raw: dict[str, Any], root: Path | str, source: str = "folder", **data: object) -> dict[str, Any]:
    """`raw` (params.yaml's mapping) reading `root` as `source`, with the tests' recipe and names. The demo's own
    source (its tests) keeps its recipe and names: `recipe: auto` picks them."""
    raw["data"].update({"source": source, "root": str(root), "download": False, **data})
    if source in ("folder", "csv"):
        raw["recipe"] = str(TEST_RECIPE)
        with_test_names(raw)
    return raw


def with_test_names(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the tests' name and every name made from it (a generated project's params.yaml sets its own)."""
    raw["name"] = SYNTHETIC_NAME
    for section, key in NAMED_KEYS:
        raw.setdefault(section, {})[key] = ""
    return raw


def make_params(root: Path, tracking: bool = False, source: str = "folder", **data: object) -> Params:
    """Params for a test run: the repo's params.yaml on the data at `root` (the tests' synthetic images, or the
    demo's data with its own source) with overrides applied."""
    import yaml

    raw = on_test_data(yaml.safe_load((REPO / "params.yaml").read_text()), root, source, **data)
    raw["tracking"] = TrackingConfig(enabled=tracking).model_dump()
    return parse_params(raw)


def train_params(**train: Any) -> Params:
    """Params for a seconds-long run of one small network: 2 epochs of 8 steps, a checkpoint every 3 steps,
    tracking off (`augment=False` turns the augment section off). Validation held out (`train_on_val=True` to
    train on it too, the shipped default), so the step counts are the training split's."""
    augment = {"enabled": train.pop("augment")} if "augment" in train else {}
    raw: dict[str, Any] = {
        "recipe": str(TEST_RECIPE),
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
