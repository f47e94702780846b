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
    """Resize Conv2d / BatchNorm / LayerNorm / Linear layers in place to the shapes in `state_dict` (pruned
    models; in place, so a library's subclasses, e.g. timm's BatchNormAct2d, keep what they add). A depthwise
    convolution stays depthwise (groups = its channels)."""
    import torch
    from torch import nn

    def blank(like: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=like.dtype)

    for name, module in list(model.named_modules()):
        prefix = f"{name}." if name else ""
        weight = state_dict.get(f"{prefix}weight")
        own = getattr(module, "weight", None)
        if weight is None or not isinstance(own, torch.Tensor) or tuple(weight.shape) == tuple(own.shape):
            continue
        if isinstance(module, nn.Conv2d):
            depthwise = module.groups > 1 and module.groups == module.in_channels == module.out_channels
            module.groups = weight.shape[0] if depthwise else module.groups
            module.out_channels, module.in_channels = weight.shape[0], weight.shape[1] * module.groups
        elif isinstance(module, nn.BatchNorm2d):
            module.num_features = weight.shape[0]
            for buffer in ("running_mean", "running_var"):
                if getattr(module, buffer, None) is not None:
                    setattr(module, buffer, blank(getattr(module, buffer), weight.shape))
        elif isinstance(module, nn.LayerNorm):
            module.normalized_shape = tuple(weight.shape)
        elif isinstance(module, nn.Linear):
            module.out_features, module.in_features = weight.shape[0], weight.shape[1]
        else:
            continue
        module.weight = nn.Parameter(blank(own, weight.shape))
        bias = state_dict.get(f"{prefix}bias")
        if bias is not None and getattr(module, "bias", None) is not None:
            module.bias = nn.Parameter(blank(module.bias, bias.shape))
    return model


def model_from_payload(payload: Mapping[str, Any], path: Path) -> nn.Module:
    """Rebuild the network a payload describes and load its weights (a StageError naming `path`)."""
    import torch

    from pipeline.architectures import nets

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
