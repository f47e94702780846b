"""A small trained model file, written through the train stage's own writer (artifacts.model)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import read_manifest, read_split


def write_model(root: Path, width: int = 8, steps: int = 80, seed: int = 0, members: int = 1) -> Path:
    """models/model.pt under `root`, fitted for `steps` full-batch steps on root's prepared train split
    (a committee of `members` networks when more than one)."""
    prepared = root / "data" / "prepared"
    manifest = read_manifest(prepared)
    size = manifest.image_size
    torch.manual_seed(seed)
    model = nets.build("signnet", manifest.mean, manifest.std, size, width=width, dropout=0.0, members=members)
    train = read_split("train", prepared)
    x = torch.from_numpy(train.images).permute(0, 3, 1, 2).float() / 255
    y = torch.from_numpy(train.labels).long()
    optim = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(*nets.member_loss_inputs(model(x), y))
        optim.zero_grad()
        loss.backward()
        optim.step()
    arch = nets.arch_kwargs("signnet", size, width, 0.0, 43, members=members)
    return model_file.write(
        root / model_file.MODEL_PATH, arch, manifest.mean, manifest.std, manifest.classes, model.eval().state_dict()
    )
