"""Structured pruning: remove whole convolution filters (smallest L1/L2 norm) and the matching input
channels of the next layer, so the pruned network is really smaller and faster (not a masked copy).

A filter followed by BatchNorm is ranked by the norm of the filter with the BN scale folded in
(|gamma| / sqrt(var + eps) x weight): BN divides the raw weight's scale out, so ranking by the raw norm
removes filters that BN scales up (the measured cost of halving the filters, with and without it: docs/results-history.md).

`prune_filters` works on conv(-BN)-...-conv(-BN)-Linear chains (signnet, trafficsignnet), where every convolution
feeds exactly the next convolution or, after the last one, the classifier's Linear (through global average
pooling, or a Flatten of C x H x W features); `plain_chain` tells such a network by its structure. Networks with
branches (residual additions, squeeze-excite, depthwise convolutions: the torchvision/timm networks, or one of
yours) go through `prune_graph`: Torch-Pruning traces the forward
into a dependency graph, so channels joined by an addition or a depthwise convolution are removed together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn


@dataclass(frozen=True)
class PruneReport:
    channels_before: list[int]
    channels_after: list[int]


def filter_norms(conv: nn.Conv2d, norm: Literal["l1", "l2"], bn: nn.BatchNorm2d | None = None) -> torch.Tensor:
    """Each filter's norm; with the following BatchNorm, of the filter as folded into the conv."""
    flat = conv.weight.detach().flatten(1)
    if bn is not None and bn.running_var is not None:
        gamma = bn.weight.detach() if bn.weight is not None else torch.ones_like(bn.running_var)
        flat = flat * (gamma.abs() / torch.sqrt(bn.running_var + bn.eps)).unsqueeze(1)
    return flat.abs().sum(1) if norm == "l1" else flat.pow(2).sum(1).sqrt()


def _chain(model: nn.Module) -> list[nn.Module]:
    layers: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.BatchNorm2d | nn.Linear)]
    if not any(isinstance(m, nn.Conv2d) for m in layers):
        raise ValueError("the model has no convolutions to prune")
    for m in layers:
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            raise ValueError("grouped convolutions are not supported by the pruner")
    return layers


@torch.no_grad()
def _keep_outputs(conv: nn.Conv2d, keep: torch.Tensor) -> None:
    conv.weight = nn.Parameter(conv.weight[keep].clone())
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias[keep].clone())
    conv.out_channels = len(keep)


@torch.no_grad()
def _keep_bn(bn: nn.BatchNorm2d, keep: torch.Tensor) -> None:
    if bn.weight is not None and bn.bias is not None:
        bn.weight = nn.Parameter(bn.weight[keep].clone())
        bn.bias = nn.Parameter(bn.bias[keep].clone())
    if bn.running_mean is not None and bn.running_var is not None:
        bn.running_mean = bn.running_mean[keep].clone()
        bn.running_var = bn.running_var[keep].clone()
    bn.num_features = len(keep)


@torch.no_grad()
def _keep_inputs(layer: nn.Module, keep: torch.Tensor, channels: int) -> None:
    if isinstance(layer, nn.Conv2d):
        layer.weight = nn.Parameter(layer.weight[:, keep].clone())
        layer.in_channels = len(keep)
        return
    assert isinstance(layer, nn.Linear)
    per_channel = layer.in_features // channels  # 1 after global pooling, H*W after a Flatten
    if per_channel * channels != layer.in_features:
        raise ValueError(f"cannot map {channels} channels onto a Linear of {layer.in_features} inputs")
    columns = (keep.view(-1, 1) * per_channel + torch.arange(per_channel).view(1, -1)).flatten()
    layer.weight = nn.Parameter(layer.weight[:, columns].clone())
    layer.in_features = len(columns)


def _bn_after(layers: list[nn.Module], i: int) -> nn.BatchNorm2d | None:
    following = layers[i + 1] if i + 1 < len(layers) else None
    return following if isinstance(following, nn.BatchNorm2d) else None


def keep_members(model: nn.Module, members: int) -> nn.Module:
    """The first `members` networks of a committee: one network, or a smaller committee; `model` itself when it
    is not a committee or `members` is 0 or not fewer than it has. Fewer, larger layers run faster per
    multiply-add than a committee of small ones (int8 ONNX Runtime here), and the fine-tune distils the whole
    committee into what is kept."""
    from pipeline.architectures.nets import Committee

    if not isinstance(model, Committee) or not 0 < members < len(model.members):
        return model
    kept = list(model.members)[:members]
    return kept[0] if members == 1 else Committee(kept)


def kept_channels(channels: int, amount: float, multiple: int = 1) -> int:
    """How many of a convolution's `channels` filters survive: round(amount x channels) removed, then rounded down
    to a multiple of `multiple` (int8 and bf16 kernels work in blocks of 8 or 16 channels: 20 channels cost
    about what 32 do), never below `multiple` (or all of them, when fewer) nor 1."""
    keep = max(1, channels - round(amount * channels))
    if multiple > 1:
        keep = min(channels, max(multiple, keep // multiple * multiple))
    return keep


def prune_graph(
    model: nn.Module,
    amount: float,
    image_size: int,
    norm: Literal["l1", "l2"] = "l1",
    multiple: int = 1,
) -> PruneReport:
    """Remove about `amount` of the channels of every prunable group of a branched network (Torch-Pruning's
    dependency graph, magnitude importance, kept counts rounded to `multiple`), in place; the classifier keeps its
    outputs (the classes)."""
    import torch_pruning as tp

    from pipeline.architectures.backbones import classifier_names

    if not 0.0 <= amount < 1.0:
        raise ValueError(f"prune amount must be in [0, 1), got {amount}")
    nets_inside = [m.get_submodule("net") for m in model.modules() if hasattr(m, "net")] or [model]
    ignored = [net.get_submodule(name) for net in nets_inside for name in classifier_names(net)]
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    before = [c.out_channels for c in convs]
    was_training = model.training
    model.eval()
    pruner = tp.pruner.MetaPruner(
        model,
        torch.rand(1, 3, image_size, image_size),
        importance=tp.importance.GroupMagnitudeImportance(p=1 if norm == "l1" else 2),
        pruning_ratio=amount,
        ignored_layers=ignored,
        round_to=multiple if multiple > 1 else None,
    )
    pruner.step()
    model.train(was_training)
    return PruneReport(before, [c.out_channels for c in convs])


def plain_chain(model: nn.Module, image_size: int) -> bool:
    """Whether `prune_filters` can prune this network: no grouped (depthwise) convolution, and every convolution's
    output channels feed on without being joined to another convolution's (an addition, as in a residual block,
    couples them). Read from Torch-Pruning's dependency graph of the traced forward, whatever the network is called."""
    import torch_pruning as tp

    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    if not convs or any(c.groups != 1 for c in convs):
        return False
    was_training = model.training
    graph = tp.DependencyGraph().build_dependency(model.eval(), example_inputs=torch.rand(1, 3, image_size, image_size))
    model.train(was_training)
    for conv in convs:
        group = graph.get_pruning_group(conv, tp.prune_conv_out_channels, idxs=[0])
        joined = {id(d.target.module) for d, _ in group if d.handler == tp.prune_conv_out_channels}
        if len(joined) > 1:
            return False
    return True


def prune_filters(model: nn.Module, amount: float, norm: Literal["l1", "l2"] = "l1", multiple: int = 1) -> PruneReport:
    """Remove about `amount` of every convolution's filters (`kept_channels`), in place."""
    if not 0.0 <= amount < 1.0:
        raise ValueError(f"prune amount must be in [0, 1), got {amount}")
    layers = _chain(model)
    convs = [(i, m) for i, m in enumerate(layers) if isinstance(m, nn.Conv2d)]
    # Rank every convolution's filters on the original weights first (one-shot pruning), then cut.
    keeps = {}
    for i, conv in convs:
        n_keep = kept_channels(conv.out_channels, amount, multiple)
        keeps[i] = torch.sort(torch.topk(filter_norms(conv, norm, _bn_after(layers, i)), n_keep).indices).values
    before, after = [], []
    for i, conv in convs:
        keep, out = keeps[i], conv.out_channels
        consumer = next((m for m in layers[i + 1 :] if isinstance(m, nn.Conv2d | nn.Linear)), None)
        if consumer is None:
            raise ValueError("a convolution with no following layer cannot be pruned")
        bn = _bn_after(layers, i)
        _keep_outputs(conv, keep)
        if bn is not None:
            _keep_bn(bn, keep)
        _keep_inputs(consumer, keep, out)
        before.append(out)
        after.append(len(keep))
    return PruneReport(before, after)
