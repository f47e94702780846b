"""Helpers for the train/evaluate tests: tiny synthetic prepared arrays and fast params (no MLflow)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import Params, parse_params


def write_prepared(
    root: Path, sizes: tuple[int, int, int] = (256, 86, 86), image_size: int = 16, seed: int = 0
) -> Path:
    """data/prepared/ under `root`: class-coloured noisy images of all 43 classes, the prepare contract."""
    rng = np.random.default_rng(seed)
    prepared = root / "data" / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    for split, count in zip(("train", "val", "test"), sizes, strict=True):
        labels = (np.arange(count) % 43).astype(np.uint8)
        ids = labels.astype(np.int64)
        colour = np.stack([(ids * 37) % 256, (ids * 91) % 256, (ids * 53) % 256], axis=1).astype(np.float32)
        noise = rng.normal(0.0, 25.0, size=(count, image_size, image_size, 3))
        images = np.clip(colour[:, None, None, :] + noise, 0, 255).astype(np.uint8)
        np.savez(prepared / f"{split}.npz", images=images, labels=labels)
    manifest = {
        "image_size": image_size,
        "mean": [0.45, 0.4, 0.35],
        "std": [0.25, 0.25, 0.25],
        "classes": [f"class {i}" for i in range(43)],
    }
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    return prepared


def train_params(**train: Any) -> Params:
    """Params for a seconds-long run: 2 epochs of 8 steps, a checkpoint every 3 steps, tracking off."""
    raw: dict[str, Any] = {
        "model": {"name": "signnet", "width": 8},
        "train": {"epochs": 2, "batch_size": 32, "checkpoint_every": 3, "threads": 1, **train},
        "evaluate": {"min_accuracy": 0.0},
        "tracking": {"enabled": False},
    }
    return parse_params(raw)


def write_params_yaml(path: Path, params: Params) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(params.model_dump(mode="json")))
    return path
