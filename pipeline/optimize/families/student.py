"""student, student-onnx, student-int8-onnx: one network of `optimize.student_width` (or another architecture,
`optimize.student`), trained from scratch on the trained model's soft targets plus labels, then exported and
quantized like the others. The teacher is only read (eval mode), so the trained model itself serves, unlike
pruning's copy."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from pipeline import console
from pipeline.architectures import nets
from pipeline.artifacts.variants import TRAINED
from pipeline.optimize.families import MetricLogger
from pipeline.optimize.finetune import distill_student

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker


def wanted(cfg: OptimizeConfig) -> bool:
    return cfg.student_width > 0 or bool(cfg.student)


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    cfg = maker.cfg
    arch = {**payload["arch"], "width": cfg.student_width or payload["arch"].get("width", 32), "members": 1}
    if cfg.student:  # another architecture: fresh weights (the teacher's initial weights do not fit it)
        arch = {**{k: v for k, v in arch.items() if k != "weights"}, "name": cfg.student}
    torch.manual_seed(cfg.seed)
    student = nets.build_from_arch(arch, payload["mean"], payload["std"])
    macs_teacher = nets.count_macs(trained, maker.image_size)
    macs_student = nets.count_macs(student, maker.image_size)
    width = f" width {arch['width']}" if not nets.is_backbone(str(arch["name"])) else ""
    console.log(
        f"student: {arch['name']}{width}, {macs_student / 1e6:.1f} M multiply-adds ({macs_student / macs_teacher:.0%} "
        f"of the trained model's {macs_teacher / 1e6:.1f} M); distilling for {cfg.student_epochs} epoch(s)"
    )
    started = time.perf_counter()
    student = distill_student(student, trained, maker.params, log)
    settings = {
        "student_of": TRAINED,
        "student_width": cfg.student_width,
        "student_architecture": str(arch["name"]),
        "student_epochs": cfg.student_epochs,
        "student_distill": cfg.student_distill,
        "student_train_seconds": round(time.perf_counter() - started, 1),
    }
    maker.torch_family(name, student, {**payload, "arch": arch}, settings)
