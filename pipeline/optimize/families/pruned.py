"""pruned, pruned-onnx, pruned-int8-onnx: `optimize.prune_amount` of the filters removed (a plain chain of
convolutions by our own ranking, any other structure by Torch-Pruning's dependency graph), fine-tuned with the trained
model as teacher, then exported and quantized like the trained model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline import console
from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from pipeline.artifacts.variants import TRAINED
from pipeline.optimize import prune
from pipeline.optimize.families import MetricLogger
from pipeline.optimize.finetune import finetune

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker


def wanted(cfg: OptimizeConfig) -> bool:
    return cfg.prune_amount > 0


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    cfg, size = maker.cfg, maker.image_size
    pruned = prune.keep_members(model_file.read(maker.staging / f"{TRAINED}.pt")[0], cfg.prune_members)
    members = len(pruned.members) if isinstance(pruned, nets.Committee) else 1
    arch = {**payload["arch"], "members": members}
    if prune.plain_chain(pruned, size):
        report = prune.prune_filters(pruned, cfg.prune_amount, cfg.prune_norm, cfg.prune_multiple)
    else:  # branches (residual additions, depthwise convolutions): Torch-Pruning's dependency graph
        report = prune.prune_graph(pruned, cfg.prune_amount, size, cfg.prune_norm, cfg.prune_multiple)
    console.log(
        f"pruned {cfg.prune_amount:.0%} of the filters ({cfg.prune_norm}) of {members} member(s): channels "
        f"{report.channels_before} -> {report.channels_after}; fine-tuning {cfg.finetune_epochs} epoch(s)"
    )
    teacher = model_file.read(maker.staging / f"{TRAINED}.pt")[0].eval()
    pruned = finetune(pruned, maker.params, log, teacher=teacher)
    settings = {
        "channels_before": str(report.channels_before),
        "channels_after": str(report.channels_after),
        "prune_amount": cfg.prune_amount,
        "prune_norm": cfg.prune_norm,
        "prune_multiple": cfg.prune_multiple,
        "prune_members": members,
        "finetune_epochs": cfg.finetune_epochs,
        "finetune_distill": cfg.finetune_distill,
    }
    maker.torch_family(name, pruned, {**payload, "arch": arch}, settings)
