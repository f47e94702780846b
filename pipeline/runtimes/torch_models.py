"""Loading the `.pt2` variants (format torch-export: the int8 pt2e graph) without running code from the file.

Its graph is JSON naming registered operators; its tensors are read here with weights_only=True only (torch's
own loader would fall back to full unpickling when that fails). The `.pt` format (torch-state-dict) is the
trained model's: pipeline/artifacts/model.py.

Imports torch: only the torch runtimes and the optimize stage import this module.
"""

from __future__ import annotations

import io
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.errors import StageError


@contextmanager
def _tensors_weights_only() -> Any:
    """Inside: torch.export.load reads tensors with weights_only=True and never falls back."""
    from torch._export.serde import serialize

    original = serialize.deserialize_torch_artifact

    def strict(serialized: Any) -> Any:
        if isinstance(serialized, dict | tuple) or len(serialized) == 0:
            return original(serialized)
        artifact = torch.load(io.BytesIO(serialized), weights_only=True)
        if not isinstance(artifact, dict | tuple):
            raise ValueError(f"expected a dict or tuple of tensors, got {type(artifact).__name__}")
        return artifact

    serialize.deserialize_torch_artifact = strict
    try:
        yield
    finally:
        serialize.deserialize_torch_artifact = original


def load_exported(path: Path) -> nn.Module:
    """The module of a torch.export archive (the int8 pt2e variant)."""
    import torchao.quantization.pt2e  # noqa: F401  (registers the quantize/dequantize operators)

    try:
        with _tensors_weights_only():
            program = torch.export.load(str(path))
    except FileNotFoundError:
        raise StageError(f"{path} not found") from None
    except Exception as exc:
        raise StageError(f"{path}: not a loadable torch.export archive ({type(exc).__name__}: {exc})") from None
    return program.module()
