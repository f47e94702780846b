"""The runtime interface: one way to run any shipped variant, for evaluation, benchmarks and serving."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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
    """The backend: its name in RUNTIME_BACKENDS (onnxruntime, torch-eager, torch-compile, ...)."""
    variant: str

    def predict(self, images: np.ndarray) -> np.ndarray:
        """float32 [N, 3, H, W] RGB in [0, 1] -> logits float32 [N, num_classes]."""
        ...


class Opener(Protocol):
    """A backend's entry: open one variant file (a ValueError says why it cannot)."""

    def __call__(
        self, path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool
    ) -> Runtime: ...


class Profiler(Protocol):
    """A backend's own operator profile (benchmark.profile): time batches of `batch` through the variant file at
    `path` and write the table, titled with `label` (the setup), to `out`."""

    def __call__(self, path: Path, batch: np.ndarray, label: str, out: Path) -> None: ...


@dataclass(frozen=True)
class Backend:
    """One way to run variant files: the formats it opens, where its opener lives, and what the stages that name no
    backend need to know of it (the table in pipeline/runtimes/__init__.py is the only place backends are named)."""

    formats: tuple[str, ...]
    """The variant file formats it runs (models/manifest.json's `format`: onnx, torch-state-dict, torch-export)."""
    opener: str
    """`module:function` (an Opener), imported only when a variant is opened: the server image has no torch."""
    requirements: tuple[str, ...] = ()
    """The pip distributions it imports: an MLflow model of a variant whose first runtime it is lists them, pinned,
    beside numpy, pillow, pandas, pydantic and pyyaml (tracking.log_variant_model). "torch" among them: it runs on
    PyTorch, and the benchmark's worker sets torch's threads and oneDNN switch before opening it."""
    image: bool = False
    """The server image runs it (docker/requirements-serve.in installs its package): evaluate measures the shipped
    variant on the first such backend of the table, and the model card names it for a variant set by hand."""
    baseline: bool = False
    """PyTorch's default eager, what users would otherwise run: the benchmark's speed-ups are against its fp32
    variant (pipeline/artifacts/benchmark_report.py). One backend of the table."""
    onednn_settings: bool = False
    """The benchmark times it with oneDNN off and on (and bf16 fast math on CPUs with native bf16) where the torch
    build has oneDNN; every other backend once, at default settings."""
    untimed: Mapping[str, str] = field(default_factory=dict)
    """Formats it opens that the benchmark does not time on it, each with the reason its report gives."""
    cuda: bool = False
    """It needs a CUDA device: the benchmark skips it on a machine without one."""
    profiler: str | None = None
    """`module:function` (a Profiler) for benchmark.profile; None: torch.profiler around `predict`."""

    @property
    def torch(self) -> bool:
        """It runs on PyTorch (needs the torch distribution)."""
        return "torch" in self.requirements


def check_batch(images: np.ndarray, size: int) -> np.ndarray:
    """The batch as a C-contiguous float32 array, or a ValueError saying what is wrong with it."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1:] != (3, size, size):
        raise ValueError(f"expected images of shape [N, 3, {size}, {size}], got {list(images.shape)}")
    if images.dtype != np.float32:
        raise ValueError(f"expected float32 images in [0, 1], got {images.dtype}")
    return np.ascontiguousarray(images)
