"""The runtime interface: one way to run any shipped variant, for evaluation, benchmarks and serving."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

# Backend names, as written in the manifest's `runtimes` lists (the table: pipeline/runtimes/__init__.py).
ONNXRUNTIME = "onnxruntime"
TORCH_EAGER = "torch-eager"
TORCH_COMPILE = "torch-compile"


@runtime_checkable
class Runtime(Protocol):
    name: str
    """The backend: onnxruntime, torch-eager or torch-compile."""
    variant: str

    def predict(self, images: np.ndarray) -> np.ndarray:
        """float32 [N, 3, H, W] RGB in [0, 1] -> logits float32 [N, num_classes]."""
        ...


class Opener(Protocol):
    """A backend's entry: open one variant file (a ValueError says why it cannot)."""

    def __call__(
        self, path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool
    ) -> Runtime: ...


@dataclass(frozen=True)
class Backend:
    """One way to run variant files: the formats it opens, and where its opener lives."""

    formats: tuple[str, ...]
    """The variant file formats it runs (models/manifest.json's `format`: onnx, torch-state-dict, torch-export)."""
    opener: str
    """`module:function` (an Opener), imported only when a variant is opened: the server image has no torch."""


def check_batch(images: np.ndarray, size: int) -> np.ndarray:
    """The batch as a C-contiguous float32 array, or a ValueError saying what is wrong with it."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1:] != (3, size, size):
        raise ValueError(f"expected images of shape [N, 3, {size}, {size}], got {list(images.shape)}")
    if images.dtype != np.float32:
        raise ValueError(f"expected float32 images in [0, 1], got {images.dtype}")
    return np.ascontiguousarray(images)
