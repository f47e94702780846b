"""Saving and loading the PyTorch variants without running code from the file.

- `.pt` (format torch-state-dict): {arch, mean, std, classes, state_dict[, variant]} as written by the
  train stage, read with torch.load(weights_only=True). Pruned models have fewer channels than their
  architecture's defaults: the layers are resized to the state_dict's shapes before loading it.
- `.pt2` (format torch-export): a torch.export archive (the int8 pt2e graph). Its graph is JSON naming
  registered operators; its tensors are read here with weights_only=True only (torch's own loader would
  fall back to full unpickling when that fails).

Imports torch: only the torch runtimes and the optimize stage import this module.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline import nets
from pipeline.errors import StageError

REQUIRED_KEYS = ("arch", "mean", "std", "state_dict")


def read_payload(path: Path) -> dict[str, Any]:
    """The saved dict of a `.pt` model file, or a StageError naming the file."""
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path} not found: run `pipeline train` first")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have many types
        raise StageError(
            f"{path} is not a model saved by `pipeline train` (cannot be read with weights_only=True: "
            f"{type(exc).__name__})"
        ) from None
    if not isinstance(payload, dict) or any(k not in payload for k in REQUIRED_KEYS):
        raise StageError(f"{path} is not a model saved by `pipeline train` (expected keys {REQUIRED_KEYS})")
    return payload


def fit_shapes(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """Resize Conv2d / BatchNorm2d / Linear layers to the shapes in `state_dict` (pruned models)."""
    for name, module in list(model.named_modules()):
        weight = state_dict.get(f"{name}.weight")
        if weight is None or tuple(weight.shape) == tuple(module.weight.shape):
            continue
        has_bias = f"{name}.bias" in state_dict
        new: nn.Module
        if isinstance(module, nn.Conv2d):
            new = nn.Conv2d(
                weight.shape[1] * module.groups,
                weight.shape[0],
                module.kernel_size,  # type: ignore[arg-type]
                stride=module.stride,  # type: ignore[arg-type]
                padding=module.padding,  # type: ignore[arg-type]
                dilation=module.dilation,  # type: ignore[arg-type]
                groups=module.groups,
                bias=has_bias,
            )
        elif isinstance(module, nn.BatchNorm2d):
            new = nn.BatchNorm2d(weight.shape[0], eps=module.eps, momentum=module.momentum)
        elif isinstance(module, nn.Linear):
            new = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return model


def model_from_payload(payload: Mapping[str, Any], path: Path) -> nn.Module:
    """Rebuild the network a payload describes and load its weights (a StageError naming `path`)."""
    arch = dict(payload["arch"])
    try:
        model = nets.build_from_arch(arch, payload["mean"], payload["std"])
        state_dict = payload["state_dict"]
        fit_shapes(model, state_dict)
        model.load_state_dict(state_dict, strict=True)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StageError(f"{path}: the weights do not match architecture {arch} ({first[:300]})") from None
    if any(p.dtype == torch.bfloat16 for p in model.parameters()):
        model = model.to(torch.bfloat16)
    return model.eval()


def load_model(path: Path) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, payload) of a `.pt` model file."""
    payload = read_payload(path)
    return model_from_payload(payload, Path(path)), payload


def save_model(path: Path, model: nn.Module, like: Mapping[str, Any], **extra: Any) -> None:
    """Save `model` with the arch/mean/std/classes of payload `like` (the train stage's format)."""
    payload = {k: v for k, v in like.items() if k != "state_dict"}
    payload.update(extra)
    payload["state_dict"] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    tmp = Path(path).with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)


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
