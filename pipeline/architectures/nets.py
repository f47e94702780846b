"""The model definitions, built by name (`model.name`).

Every network takes float images in [0, 1], NCHW, and normalises them itself with the per-channel mean/std
of the training split (buffers filled from the prepared manifest), so every consumer (evaluate, ONNX
export, the server) feeds the same uint8 -> float[0,1] pixels and cannot drift from training.

- ours, one file each in pipeline/architectures/ (`signnet`, `trafficsignnet`), or a file of your project
  (`model.name: path/to/file.py:function`);
- `torchvision/<arch>`, `timm/<arch>`: the libraries' networks (`Backbone`, pipeline/architectures/backbones.py), normalised
  with the mean/std their weights expect (the payload's mean/std).

`model.members` > 1 wraps either in a `Committee` of independently initialised copies that vote (the
IJCNN 2011 winner was a committee too); it is still one module, so training, checkpoints, ONNX export,
quantisation and serving treat it like any network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from pipeline import architectures
from pipeline.architectures import NetSpec

NUM_CLASSES = 43
ARCHITECTURES = tuple(architectures.ARCHITECTURES)  # ours by name; pipeline/architectures/ has one file each


def is_backbone(name: str) -> bool:
    """A library network (`torchvision/<arch>`, `timm/<arch>`: backbones.FAMILIES), not one of ours."""
    from pipeline.architectures.backbones import FAMILIES

    family, sep, arch = name.partition("/")
    return bool(sep) and family in FAMILIES and bool(arch)


def trained_members(name: str, members: int) -> int:
    """The committee size a run trains: `model.members`, but one for a library network (copies of one set of
    pretrained weights would be the same network)."""
    return 1 if is_backbone(name) else members


def backbone_parts(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(backbone, head) parameters of a model whose members are `Backbone`s (the head: each classifier); ([], all)
    for our own networks, which train as one."""
    from pipeline.architectures.backbones import classifier_names

    members = list(model.members) if isinstance(model, Committee) else [model]
    if not all(isinstance(m, Backbone) for m in members):
        return [], list(model.parameters())
    head: list[nn.Parameter] = []
    for member in members:
        net = member.get_submodule("net")
        for name in classifier_names(net):
            head += list(net.get_submodule(name).parameters())
    ids = {id(p) for p in head}
    return [p for p in model.parameters() if id(p) not in ids], head


INPUT_NORMS = ("dataset", "image")


class Normalize(nn.Module):
    """`dataset`: (x - mean) / std per channel with the training split's statistics (buffers, so they
    travel with the state_dict). `image`: each image standardised by its own mean and std over all pixels
    and channels (a global contrast normalisation: road-sign photos are often very dark or washed out, and this
    makes them look alike to the first layer, while keeping colour)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float], mode: str = "dataset") -> None:
        super().__init__()
        if mode not in INPUT_NORMS:
            raise ValueError(f"unknown input normalisation {mode!r}; choose one of {', '.join(INPUT_NORMS)}")
        self.mode = mode
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "image":
            mean = x.mean(dim=(1, 2, 3), keepdim=True)
            centred = x - mean
            # The floor keeps flat images (std ~ 0) from being blown up into noise.
            std = torch.sqrt(centred.pow(2).mean(dim=(1, 2, 3), keepdim=True) + 1e-4)
            return centred / std
        return (x - self.mean) / self.std


class Backbone(nn.Module):
    """A network users bring by name (`torchvision/<arch>`, `timm/<arch>`: pipeline/architectures/backbones.py) behind the same
    contract as ours: [0, 1] pixels in, normalised inside with the mean/std its weights expect."""

    def __init__(self, name: str, mean: Sequence[float], std: Sequence[float], num_classes: int) -> None:
        super().__init__()
        from pipeline.architectures import backbones

        self.normalize = Normalize(mean, std, "dataset")
        self.net = backbones.library_network(name, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.normalize(x))


class Committee(nn.Module):
    """Several networks of one architecture, each initialised differently, that vote.

    In training mode `forward` returns every member's logits stacked, [members, batch, classes], so each
    member learns from its own loss (`member_loss_inputs`): a loss on the averaged output would couple the
    members and cost the diversity the vote lives on. In eval mode it returns the log of the members' mean
    probability, so softmax gives the committee's probabilities and argmax its vote."""

    def __init__(self, members: Sequence[nn.Module]) -> None:
        super().__init__()
        if len(members) < 2:
            raise ValueError("a committee needs at least 2 members")
        self.members = nn.ModuleList(members)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.stack([member(x) for member in self.members])
        if self.training:
            return logits
        return torch.logsumexp(torch.log_softmax(logits, dim=-1), dim=0) - math.log(len(self.members))


def member_loss_inputs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Training outputs as (logits [n, classes], labels [n]): a committee's members are stacked along the
    batch, so a summed loss is the sum of the members' own losses."""
    if logits.dim() == 3:
        return logits.flatten(0, 1), labels.repeat(logits.shape[0])
    return logits, labels


def build(
    name: str,
    mean: Sequence[float],
    std: Sequence[float],
    image_size: int,
    width: int = 32,
    dropout: float = 0.2,
    num_classes: int = NUM_CLASSES,
    input_norm: str = "dataset",
    members: int = 1,
) -> nn.Module:
    """The network called `name`, with the normalisation of the prepared data built in; a `Committee` of
    `members` copies when more than one."""
    if members < 1:
        raise ValueError(f"members must be >= 1, got {members}")

    spec = NetSpec(tuple(mean), tuple(std), image_size, num_classes, width, dropout, input_norm)
    build_one = None if is_backbone(name) else architectures.builder(name)

    def one() -> nn.Module:
        return Backbone(name, mean, std, num_classes) if build_one is None else build_one(spec)

    if members == 1:
        return one()
    return Committee([one() for _ in range(members)])


def arch_kwargs(
    name: str,
    image_size: int,
    width: int = 32,
    dropout: float = 0.2,
    num_classes: int = NUM_CLASSES,
    input_norm: str = "dataset",
    members: int = 1,
) -> dict[str, object]:
    """The keyword arguments (besides mean/std) that `build` needs, stored with the saved model."""
    return {
        "name": name,
        "image_size": image_size,
        "width": width,
        "dropout": dropout,
        "num_classes": num_classes,
        "input_norm": input_norm,
        "members": members,
    }


def build_from_arch(arch: Mapping[str, Any], mean: Sequence[float], std: Sequence[float]) -> nn.Module:
    """Rebuild a saved model's network from its stored `arch_kwargs` (older files lack newer keys)."""
    return build(
        str(arch["name"]),
        mean,
        std,
        int(arch["image_size"]),
        width=int(arch.get("width", 32)),
        dropout=float(arch.get("dropout", 0.2)),
        num_classes=int(arch.get("num_classes", NUM_CLASSES)),
        input_norm=str(arch.get("input_norm", "dataset")),
        members=int(arch.get("members", 1)),
    )


def count_macs(model: nn.Module, image_size: int) -> int:
    """Multiply-adds of one forward pass over one image (torch.utils.flop_counter: convolutions and matrix
    products; FLOPs / 2), in eval mode (a committee's vote, every member)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.rand(1, 3, image_size, image_size))
    model.train(was_training)
    return counter.get_total_flops() // 2


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
