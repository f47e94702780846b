"""int8-pt2e: torchao's PT2E static int8 of the trained model (x86 inductor or Arm's quantizer by platform),
calibrated on training images; it runs int8 kernels compiled only, so torch.compile serves it first."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING, Any

from pipeline.architectures import nets
from pipeline.artifacts.variants import TRAINED
from pipeline.optimize import quantize
from pipeline.optimize.families import MetricLogger
from pipeline.runtimes import TORCH_COMPILE, runtimes_for

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker


def wanted(cfg: OptimizeConfig) -> bool:
    return cfg.int8_torch


def make(maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger) -> None:
    from pipeline.optimize.candidates import Candidate

    runtimes = runtimes_for("torch-export", first=TORCH_COMPILE)  # pt2e int8 runs int8 kernels compiled only
    c = Candidate(name, f"{name}.pt2", "torch-export", runtimes, "int8", nets.count_parameters(trained), TRAINED)

    def make_file() -> None:
        batch = maker.budget.eval_batch(quantize.CALIBRATION_BATCH, "int8 calibration batch")
        c.details.update(
            quantize.quantize_pt2e(trained, maker.calibration, maker.staging / c.file, batch_size=batch),
            machine=platform.machine(),
        )

    maker.attempt(c, make_file)
