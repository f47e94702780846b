"""PyTorch backends: eager, and torch.compile (Inductor; lowers the pt2e int8 graph to int8 kernels)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeline.artifacts import model as model_file
from pipeline.runtimes.base import TORCH_COMPILE, TORCH_EAGER, check_batch
from pipeline.runtimes.torch_models import load_exported


class TorchRuntime:
    def __init__(
        self,
        path: Path,
        fmt: str,
        variant: str,
        image_size: int,
        backend: str = TORCH_EAGER,
        threads: int | None = None,
    ) -> None:
        if backend not in (TORCH_EAGER, TORCH_COMPILE):
            raise ValueError(f"not a torch backend: {backend!r}")
        if threads:
            torch.set_num_threads(threads)
        self.name = backend
        self.variant = variant
        self.image_size = image_size
        module: nn.Module = load_exported(path) if fmt == "torch-export" else model_file.read(path)[0]
        self.dtype = next(iter(module.state_dict().values())).dtype
        if self.dtype not in (torch.float32, torch.bfloat16):
            self.dtype = torch.float32
        self.module = module
        self.fn: nn.Module = module
        if backend == TORCH_COMPILE:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True  # constant-folds weights: needed for the int8 kernels
            self.fn = torch.compile(module)  # type: ignore[assignment]

    def predict(self, images: np.ndarray) -> np.ndarray:
        batch = torch.from_numpy(check_batch(images, self.image_size))
        with torch.inference_mode():
            logits = self.fn(batch.to(self.dtype))
        return logits.float().numpy()


def open_eager(path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool) -> TorchRuntime:
    """The Opener of the table: PyTorch eager."""
    return TorchRuntime(path, fmt, variant, image_size, TORCH_EAGER, threads)


def open_compiled(path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool) -> TorchRuntime:
    """The Opener of the table: torch.compile (Inductor)."""
    return TorchRuntime(path, fmt, variant, image_size, TORCH_COMPILE, threads)
