"""fp32 (the trained model as shipped), fp32-onnx (its ONNX export, checked for parity) and int8-onnx (ONNX Runtime's
static int8, calibrated on training images): always made, the reference of the gate."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.optimize.families import MetricLogger

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker


def wanted(cfg: OptimizeConfig) -> bool:
    return True


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    maker.torch_family(name, trained, payload, {})
