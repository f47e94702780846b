"""bf16: the trained model's weights in bfloat16, made where the CPU computes bf16 natively (`optimize.bf16: auto`)
or always (`on`); elsewhere bf16 is emulated and slower than fp32."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pipeline import console
from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from pipeline.artifacts.variants import TRAINED
from pipeline.optimize import quantize
from pipeline.optimize.families import MetricLogger
from pipeline.runtimes import runtimes_for

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker


def wanted(cfg: OptimizeConfig) -> bool:
    return cfg.bf16 != "off"


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    from pipeline.optimize.candidates import Candidate

    native = quantize.has_native_bf16()
    if maker.cfg.bf16 == "auto" and not native:
        console.log("bf16: skipped (this CPU has no native bf16; set optimize.bf16 to `on` to force it)")
        return
    bf16_model = model_file.read(maker.staging / f"{TRAINED}.pt")[0].to(torch.bfloat16)
    fmt = "torch-state-dict"
    c = Candidate(name, f"{name}.pt", fmt, runtimes_for(fmt), "bf16", nets.count_parameters(trained), TRAINED)
    c.details["native_bf16"] = native
    maker.attempt(c, lambda: model_file.write_like(maker.staging / c.file, bf16_model, payload, variant=name))
