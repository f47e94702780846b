"""The toy variant family of tests/optimize/test_families.py: this one file and one line in VARIANT_FAMILIES make a
variant that optimize makes and gates, the benchmark times, evaluate measures and the server serves. The trained
model with every weight rounded to half precision, kept in fp32 and exported to ONNX: a file the image's backend
opens."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from pipeline.architectures import nets
from pipeline.artifacts.variants import TRAINED
from pipeline.optimize import export
from pipeline.runtimes import runtimes_for

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker
    from pipeline.optimize.families import MetricLogger


def wanted(cfg: OptimizeConfig) -> bool:
    return True


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    from pipeline.optimize.candidates import Candidate

    rounded = copy.deepcopy(trained)
    with torch.no_grad():
        for tensor in rounded.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.half().float())
    c = Candidate(name, f"{name}.onnx", "onnx", runtimes_for("onnx"), "fp32", nets.count_parameters(rounded), TRAINED)
    maker.attempt(c, lambda: export.export_onnx(rounded, maker.staging / c.file, maker.image_size))
