"""The runtime interface: one way to run any shipped variant, for evaluation, benchmarks and serving."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

# Backend names, as written in the manifest's `runtimes` lists.
ONNXRUNTIME = "onnxruntime"
TORCH_EAGER = "torch-eager"
TORCH_COMPILE = "torch-compile"
BACKENDS = (ONNXRUNTIME, TORCH_EAGER, TORCH_COMPILE)


@runtime_checkable
class Runtime(Protocol):
    name: str
    """The backend: onnxruntime, torch-eager or torch-compile."""
    variant: str

    def predict(self, images: np.ndarray) -> np.ndarray:
        """float32 [N, 3, H, W] RGB in [0, 1] -> logits float32 [N, num_classes]."""
        ...


def check_batch(images: np.ndarray, size: int) -> np.ndarray:
    """The batch as a C-contiguous float32 array, or a ValueError saying what is wrong with it."""
    if not isinstance(images, np.ndarray):
        raise ValueError(f"expected a numpy array, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1:] != (3, size, size):
        raise ValueError(f"expected images of shape [N, 3, {size}, {size}], got {list(images.shape)}")
    if images.dtype != np.float32:
        raise ValueError(f"expected float32 images in [0, 1], got {images.dtype}")
    return np.ascontiguousarray(images)
