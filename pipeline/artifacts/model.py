"""models/model.pt: the trained network (train -> evaluate, optimize), and the same format for the optimize
stage's PyTorch variants (models/variants/{fp32,pruned,bf16}.pt).

A dict {arch, mean, std, classes, state_dict[, variant]} saved with torch.save and read with
torch.load(weights_only=True): loading never runs code from the file. `arch` is nets.arch_kwargs's record,
the one way to rebuild the network (nets.build_from_arch). Pruned models have fewer channels than their
architecture's defaults: the layers are resized to the state_dict's shapes before loading it.
Imports torch (lazily, inside the functions): the server image never reads this file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.artifacts import MODELS_DIR
from pipeline.errors import StageError

if TYPE_CHECKING:
    import torch
    from torch import nn

MODEL_PATH = MODELS_DIR / "model.pt"
REQUIRED_KEYS = ("arch", "mean", "std", "state_dict")


def write(
    path: Path,
    arch: Mapping[str, Any],
    mean: Sequence[float],
    std: Sequence[float],
    classes: Sequence[str],
    state_dict: Mapping[str, torch.Tensor],
    **extra: Any,
) -> Path:
    """Save a model file atomically (a temporary file renamed over `path`)."""
    import torch

    payload: dict[str, Any] = {"arch": dict(arch), "mean": list(mean), "std": list(std), "classes": list(classes)}
    payload.update(extra)
    payload["state_dict"] = {k: v.detach().cpu().clone() for k, v in state_dict.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
    return path


def write_like(path: Path, model: nn.Module, like: Mapping[str, Any], **extra: Any) -> Path:
    """Save `model` with the arch/mean/std/classes of payload `like` (a variant derived from the trained model)."""
    rest = {k: v for k, v in like.items() if k not in (*REQUIRED_KEYS, "classes")}
    rest.update(extra)
    return write(path, like["arch"], like["mean"], like["std"], like.get("classes", []), model.state_dict(), **rest)


def read_payload(path: Path = MODEL_PATH) -> dict[str, Any]:
    """The saved dict of a model file, or a StageError naming the file."""
    import torch

    path = Path(path)
    if not path.exists():
        raise StageError(f"{path} not found: run `pipeline train` first")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have many types
        raise StageError(
            f"{path} is not a model saved by `pipeline train` (cannot be read with weights_only=True: "
            f"{type(exc).__name__}); rerun `pipeline train`"
        ) from None
    if not isinstance(payload, dict) or any(k not in payload for k in REQUIRED_KEYS):
        raise StageError(f"{path} is not a model saved by `pipeline train` (expected keys {REQUIRED_KEYS})")
    return payload


def fit_shapes(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> nn.Module:
    """Resize Conv2d / BatchNorm2d / Linear layers to the shapes in `state_dict` (pruned models)."""
    from torch import nn

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
    import torch

    from pipeline import nets

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


def read(path: Path = MODEL_PATH) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, payload) of a model file."""
    payload = read_payload(path)
    return model_from_payload(payload, Path(path)), payload


def check_against(payload: Mapping[str, Any], path: Path, num_classes: int, image_size: int) -> None:
    """A StageError when the model was not made for data of `num_classes` classes at `image_size` px."""
    arch = payload["arch"]
    if int(arch.get("num_classes", num_classes)) != num_classes:
        raise StageError(
            f"{path}: the model has {arch.get('num_classes')} classes, the prepared data {num_classes}; "
            "retrain (`pipeline train`) on this data"
        )
    if int(arch["image_size"]) != image_size:
        raise StageError(
            f"{path}: the model was trained at {arch['image_size']}x{arch['image_size']}, the prepared "
            f"data is {image_size}x{image_size}; retrain (`pipeline train`) or re-prepare"
        )
