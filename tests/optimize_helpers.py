"""Tiny prepared data and models for the optimize / runtimes tests (seconds, not minutes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipeline import nets

CLASSES = [f"class {i}" for i in range(43)]
MEAN, STD = [0.3, 0.3, 0.3], [0.25, 0.25, 0.25]


def _split(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A noisy background with a class-coloured square: learnable by a tiny network in a few steps."""
    labels = rng.integers(0, 43, n)
    images = rng.integers(0, 60, (n, size, size, 3)).astype(np.uint8)
    for i, label in enumerate(labels):
        images[i, 2:-2, 2:-2] = [(label * 37) % 256, (label * 91) % 256, (label * 53) % 256]
    return images, labels.astype(np.uint8)


def write_prepared(root: Path, size: int = 16, n_train: int = 430, n_test: int = 129, seed: int = 0) -> Path:
    """data/prepared/{train,val,test}.npz + manifest.json under `root`, as the prepare stage writes them."""
    rng = np.random.default_rng(seed)
    prepared = root / "data" / "prepared"
    prepared.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", n_train), ("val", n_test), ("test", n_test)):
        images, labels = _split(rng, n, size)
        np.savez(prepared / f"{name}.npz", images=images, labels=labels)
    manifest = {"image_size": size, "roi_margin": 0.1, "classes": CLASSES, "mean": MEAN, "std": STD}
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    return prepared


def write_model(root: Path, size: int = 16, width: int = 8, steps: int = 80, seed: int = 0, members: int = 1) -> Path:
    """models/model.pt in the train stage's format, fitted for `steps` full-batch steps on train.npz
    (a committee of `members` networks when more than one)."""
    torch.manual_seed(seed)
    model = nets.build("signnet", MEAN, STD, size, width=width, dropout=0.0, members=members)
    with np.load(root / "data" / "prepared" / "train.npz") as arrays:
        x = torch.from_numpy(arrays["images"]).permute(0, 3, 1, 2).float() / 255
        y = torch.from_numpy(arrays["labels"]).long()
    optim = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(*nets.member_loss_inputs(model(x), y))
        optim.zero_grad()
        loss.backward()
        optim.step()
    path = root / "models" / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "arch": nets.arch_kwargs("signnet", size, width, 0.0, 43, members=members),
        "mean": MEAN,
        "std": STD,
        "classes": CLASSES,
        "state_dict": model.eval().state_dict(),
    }
    torch.save(payload, path)
    return path
