"""fp32 ONNX export (dynamo exporter, dynamic batch) and its parity check against torch."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

INPUT_NAME = "images"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class ParityResult:
    max_abs_diff: float
    top1_agreement: float
    passed: bool


def export_onnx(model: nn.Module, path: Path, image_size: int) -> Path:
    """Write `model` as a self-contained ONNX file with input `images` [batch, 3, S, S]."""
    model = model.eval().float()
    example = torch.rand(2, 3, image_size, image_size)
    batch = torch.export.Dim("batch", min=1, max=65536)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            str(path),
            dynamo=True,
            external_data=False,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},),
            verbose=False,
        )
    return path


def parity(
    reference: np.ndarray, candidate: np.ndarray, max_abs_diff: float, min_top1_agreement: float
) -> ParityResult:
    diff = float(np.abs(reference.astype(np.float64) - candidate.astype(np.float64)).max())
    agree = float((reference.argmax(1) == candidate.argmax(1)).mean())
    return ParityResult(diff, agree, diff <= max_abs_diff and agree >= min_top1_agreement)
