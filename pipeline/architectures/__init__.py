"""Networks of our own, by `model.name`: one module each, one line in ARCHITECTURES.

A module here exposes `build(spec: NetSpec) -> nn.Module` (the `Architecture` protocol): a network that takes float
images in [0, 1], NCHW, and normalises them itself (`pipeline.architectures.nets.Normalize`), with `spec.num_classes` outputs.
torchvision and timm networks come by name without a module (`torchvision/<arch>`, `timm/<arch>`: pipeline.architectures.backbones),
and a network of your own project by its file: `model.name: nets/mine.py:build` (the file relative to the project,
then the function). docs/extending.md has the checklist.

Light on purpose (no torch import): params validation reads the table.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch import nn

ARCHITECTURES: dict[str, str] = {
    "signnet": "pipeline.architectures.signnet",  # the demo's compact VGG-style CNN
    "trafficsignnet": "pipeline.architectures.trafficsignnet",  # Arm's learning-path reference network
}
# A network in your project's own file: `path/to/file.py:function` (relative to the project folder).
PROJECT_FILE = re.compile(r"^(?P<file>[\w./-]+\.py):(?P<function>[A-Za-z_]\w*)$")


@dataclass(frozen=True)
class NetSpec:
    """What a network is built from: the data's statistics, input size and classes, and model.* settings."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    image_size: int
    num_classes: int
    width: int = 32
    dropout: float = 0.2
    input_norm: str = "dataset"


class Architecture(Protocol):
    def __call__(self, spec: NetSpec) -> nn.Module: ...


def is_known(name: str) -> bool:
    """A name `model.name` may take for a network of ours: a registered one, or a project file's function."""
    return name in ARCHITECTURES or PROJECT_FILE.match(name) is not None


# The model.* keys a network of ours reads from its NetSpec, unless its module names fewer (`SETTINGS`).
OWN_SETTINGS = ("width", "dropout", "input_norm")


def settings_used(name: str) -> tuple[str, ...]:
    """The model.* keys, besides `name`, that shape this network: what a card lists for it (a library network reads
    its weights, not signnet's width or normalisation)."""
    if not is_known(name):  # torchvision/<arch>, timm/<arch>: config admits nothing else
        return ("weights", "weights_sha256")
    module = ARCHITECTURES.get(name)
    own = getattr(importlib.import_module(module), "SETTINGS", OWN_SETTINGS) if module else OWN_SETTINGS
    return (*own, "members")


def builder(name: str) -> Architecture:
    """The `build` function of a registered network or of a project file (a ValueError naming the choices)."""
    if name in ARCHITECTURES:
        return importlib.import_module(ARCHITECTURES[name]).build
    match = PROJECT_FILE.match(name)
    if match is None:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(ARCHITECTURES)}, torchvision/<arch>, timm/<arch> "
            "or a file of your project: path/to/file.py:function"
        )
    path = Path(match["file"])
    if not path.is_file():
        raise ValueError(f"model {name!r}: {path} is not a file (a path relative to the project folder)")
    spec = importlib.util.spec_from_file_location(f"project_net_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    function = getattr(module, match["function"], None)
    if function is None:
        raise ValueError(f"model {name!r}: {path} has no {match['function']}")
    return function
