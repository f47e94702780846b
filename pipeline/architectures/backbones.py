"""Networks users bring by name: `torchvision/<arch>` (any classification builder of torchvision.models) and
`timm/<arch>` (timm.create_model), with their weights: `none`, `package` (an installed package's file:
pipeline/architectures/weights.py), `default` (the library's own pretrained file, through the library's own cache:
TORCH_HOME, HF_HOME), a path to a `.safetensors` / `.pth` state dict, or `auto` (the first of package, default
that can be had, else random weights, said so).

Weights never run code: `.pth` files load with `torch.load(weights_only=True)`, safetensors hold tensors only.
The classifier is always sized from the data's classes and initialised fresh; every other tensor must fit the
network, else one line names the file and the first tensor that does not. The input the weights expect
(mean/std, interpolation) is part of the `WeightsInfo` that train records with the architecture.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from pipeline.architectures import weights as packaged_weights
from pipeline.artifacts.checksum import sha256_of

FAMILIES = ("torchvision", "timm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class WeightsError(ValueError):
    """Weights that cannot be used: the message is one line naming the file and what is wrong."""


def check_name(name: str) -> None:
    """A ValueError in one line when `name` is no network of its library."""
    family, _, arch = name.partition("/")
    if family == "torchvision":
        import torchvision.models as tvm

        known = tvm.list_models(module=tvm)  # classification builders only (not detection, segmentation, video)
        if arch not in known:
            raise ValueError(
                f"model.name {name!r}: torchvision has no classification model {arch!r} (e.g. {known[:4]})"
            )
    elif family == "timm":
        import timm

        if not timm.is_model(arch):
            raise ValueError(f"model.name {name!r}: timm has no model {arch!r} (timm.list_models() lists them)")
    else:
        raise ValueError(f"model.name {name!r}: expected torchvision/<arch> or timm/<arch>")


def library_network(name: str, num_classes: int) -> nn.Module:
    """The library's network with a fresh `num_classes` head and no pretrained weights."""
    check_name(name)
    family, _, arch = name.partition("/")
    if family == "torchvision":
        import torchvision.models as tvm

        return tvm.get_model(arch, weights=None, num_classes=num_classes)
    import timm

    return timm.create_model(arch, pretrained=False, num_classes=num_classes)


def classifier_names(net: nn.Module) -> list[str]:
    """Module names of the network's classifier (its last Linear, or timm's `get_classifier()`)."""
    get = getattr(net, "get_classifier", None)
    if callable(get):
        head = get()
        names = [n for n, m in net.named_modules() if m is head and n]
        if names:
            return names
    linear = [n for n, m in net.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    return linear[-1:]


@dataclass(frozen=True)
class WeightsInfo:
    """Where a backbone's initial weights came from and the input they expect (recorded with the architecture)."""

    source: str  # none | package | default | the path given | random (auto found no pretrained file)
    file: str = ""  # the file read (default: in the library's cache)
    sha256: str = ""
    license: str = ""
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    interpolation: str = "bilinear"
    note: str = ""  # why `auto` started from random weights

    def record(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _expected_input(name: str) -> tuple[tuple[float, ...], tuple[float, ...], str, str]:
    """(mean, std, interpolation, licence) of the library's default weights for `name`."""
    family, _, arch = name.partition("/")
    if family == "timm":
        from timm.models import get_pretrained_cfg

        cfg = get_pretrained_cfg(arch)
        if cfg is None:
            return IMAGENET_MEAN, IMAGENET_STD, "bilinear", ""
        return tuple(cfg.mean), tuple(cfg.std), str(cfg.interpolation or "bilinear"), str(cfg.license or "")
    import torchvision.models as tvm

    try:
        weights = tvm.get_model_weights(arch).DEFAULT
    except (ValueError, AttributeError, KeyError):
        return IMAGENET_MEAN, IMAGENET_STD, "bilinear", ""
    t = weights.transforms()
    recipe = str(weights.meta.get("recipe", ""))
    licence = f"not stated by torchvision; recipe {recipe}" if recipe else "not stated by torchvision"
    return tuple(t.mean), tuple(t.std), str(t.interpolation.value), licence


def expected_interpolation(name: str, weights: str = "default") -> Literal["bilinear", "bicubic"]:
    """The resize filter `name`'s pretrained weights (`model.weights`) were made with: data.interpolation's `auto`."""
    if name.partition("/")[0] not in FAMILIES:  # signnet / trafficsignnet: no pretrained weights
        return "bilinear"
    record = packaged_weights.packaged(name)
    if record is not None and weights in ("auto", "package"):
        return "bicubic" if record.interpolation == "bicubic" else "bilinear"
    return "bicubic" if _expected_input(name)[2] == "bicubic" else "bilinear"


def _default_file(name: str) -> Path:
    """The library's pretrained file for `name`, from its cache (downloaded there first when the network allows)."""
    family, _, arch = name.partition("/")
    if family == "torchvision":
        import torchvision.models as tvm

        try:
            url = str(tvm.get_model_weights(arch).DEFAULT.url)
        except (ValueError, AttributeError, KeyError):
            raise WeightsError(f"model.weights default: torchvision has no pretrained weights for {arch}") from None
        cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(url)
        if not cached.is_file():
            try:
                _reachable(url)
                cached.parent.mkdir(parents=True, exist_ok=True)
                torch.hub.download_url_to_file(url, str(cached), progress=False)
            except Exception as exc:  # no network, proxy, disk: one line with the fix
                raise WeightsError(
                    f"model.weights default: {cached} is not in torchvision's cache (TORCH_HOME) and cannot be "
                    f"downloaded ({type(exc).__name__}); fetch {url} on a machine with internet into that folder"
                ) from None
        return cached
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(arch)
    if cfg is None or not cfg.hf_hub_id:
        raise WeightsError(f"model.weights default: timm has no pretrained weights on the Hub for {arch}")
    try:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(cfg.hf_hub_id, "model.safetensors", local_files_only=True))
        except Exception:  # not cached: download it, when the Hub answers at all (else no minute of retries)
            _reachable("https://huggingface.co")
            return Path(hf_hub_download(cfg.hf_hub_id, "model.safetensors"))
    except Exception as exc:
        raise WeightsError(
            f"model.weights default: {cfg.hf_hub_id}/model.safetensors is not in the Hugging Face cache (HF_HOME) "
            f"and cannot be downloaded ({type(exc).__name__}); on a machine with internet run "
            f"`python -c \"import timm; timm.create_model('{arch}', pretrained=True)\"` and copy HF_HOME here"
        ) from None


def _reachable(url: str, timeout_s: float = 5.0) -> None:
    """An OSError at once when `url`'s host does not answer (no network): libraries would retry for a minute."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(url).hostname or ""
    with socket.create_connection((host, 443), timeout=timeout_s):
        pass


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a `.safetensors` file or a `.pth`/`.pt`/`.bin` state dict (weights_only: nothing runs)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:
            raise WeightsError(f"{path}: not a readable safetensors file ({str(exc).splitlines()[0][:200]})") from None
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors have many types
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise WeightsError(
            f"{path}: refused, not a plain state dict of tensors (torch.load with weights_only=True: {first}); "
            "a pickle that needs code to load could run it: save the weights with torch.save(model.state_dict()) "
            "or as .safetensors"
        ) from None
    for key in ("state_dict", "model", "model_state_dict"):  # common checkpoint wrappers
        if isinstance(loaded, Mapping) and isinstance(loaded.get(key), Mapping):
            loaded = loaded[key]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsError(f"{path}: not a state dict (a mapping of names to tensors)")
    return dict(loaded)


def resolve(name: str, weights: str, sha256: str = "") -> tuple[WeightsInfo, dict[str, torch.Tensor] | None]:
    """The weights `model.weights` names for backbone `name`, checked (file, hash), with the input they expect."""
    check_name(name)
    mean, std, interpolation, licence = _expected_input(name)
    if weights == "none":
        return WeightsInfo("none", interpolation=interpolation), None
    if weights == "auto":
        return _first_available(name, sha256)
    if weights == "package":
        return _from_package(name, sha256)
    if weights == "default":
        path = _default_file(name)
    else:
        path = Path(weights)
        if not path.is_file():
            raise WeightsError(f"model.weights {path}: no such file")
        licence = ""  # a file of the user's: its licence is theirs to state
    digest = _checked_sha256(path, sha256)
    state = read_state_dict(path)
    return WeightsInfo(weights, str(path), digest, licence, mean, std, interpolation), state


def _first_available(name: str, sha256: str) -> tuple[WeightsInfo, dict[str, torch.Tensor] | None]:
    """`auto`: the pinned package's weights where the table has them (the same file online and offline), else the
    library's cache or Hub, else random weights with the reasons in `note`."""
    reasons = []
    for source in ("package", "default"):
        if source == "package" and packaged_weights.packaged(name) is None:
            continue
        try:
            return resolve(name, source, sha256)
        except (WeightsError, LookupError) as exc:
            reasons.append(str(exc))
    return WeightsInfo("random", interpolation=_expected_input(name)[2], note="; ".join(reasons)), None


def _from_package(name: str, sha256: str) -> tuple[WeightsInfo, dict[str, torch.Tensor]]:
    """An installed package's weights for `name` (weights.PACKAGES), under the network's own tensor names."""
    record = packaged_weights.packaged(name)
    try:
        path = packaged_weights.package_file(name)
    except LookupError as exc:
        raise WeightsError(str(exc)) from None
    digest = _checked_sha256(path, sha256)
    state = read_state_dict(path)
    if record is not None and record.names == "by_position":  # the library's classifier (1000 classes) included
        try:
            state = packaged_weights.by_position(state, library_network(name, 1000).state_dict())
        except ValueError as exc:
            raise WeightsError(f"{path}: does not fit {name}: {exc}") from None
    assert record is not None  # package_file raised otherwise
    info = WeightsInfo("package", str(path), digest, record.license, record.mean, record.std, record.interpolation)
    return info, state


def _checked_sha256(path: Path, expected: str) -> str:
    digest = sha256_of(path)
    if expected and digest != expected.lower():
        raise WeightsError(f"{path}: sha256 is {digest}, not model.weights_sha256 {expected}")
    return digest


def load_into(net: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> list[str]:
    """Load every tensor of `state` but the classifier's into `net` (the classifier stays fresh); a WeightsError
    in one line for a tensor the network lacks or has in another shape, or one it has that `state` lacks.
    Returns the classifier keys left fresh."""
    head = classifier_names(net)
    is_head = lambda key: any(key == h or key.startswith(h + ".") for h in head)  # noqa: E731
    own = net.state_dict()
    body = {k: v for k, v in state.items() if not is_head(k)}
    unknown = [k for k in body if k not in own]
    if unknown:
        raise WeightsError(f"{where}: {len(unknown)} tensors the network does not have, e.g. {unknown[0]!r}")
    wrong = [k for k, v in body.items() if tuple(v.shape) != tuple(own[k].shape)]
    if wrong:
        k = wrong[0]
        raise WeightsError(f"{where}: {k} is {tuple(body[k].shape)}, the network's is {tuple(own[k].shape)}")
    missing = [k for k in own if not is_head(k) and k not in body and not k.endswith("num_batches_tracked")]
    if missing:
        raise WeightsError(f"{where}: {len(missing)} of the network's tensors are missing, e.g. {missing[0]!r}")
    net.load_state_dict(body, strict=False)
    return [k for k in own if is_head(k)]
