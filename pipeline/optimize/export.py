"""fp32 ONNX export (dynamic batch) and its parity check against torch."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

INPUT_NAME = "images"
OUTPUT_NAME = "logits"


@dataclass(frozen=True)
class ParityResult:
    max_abs_diff: float
    max_rel_diff: float  # each image's largest |diff| over its largest |logit|, the worst image
    top1_agreement: float
    passed: bool


def export_onnx(model: nn.Module, path: Path, image_size: int) -> Path:
    """Write `model` as a self-contained ONNX file with input `images` [batch, 3, S, S] and a dynamic batch.

    torch's tracing exporter first: a fraction of the dynamo exporter's time (torch.export's decompositions), on every
    export of every run (docs/ci.md measures both). Where tracing cannot take the network, or in a torch without that
    exporter, the dynamo exporter writes it. Either file then passes the same parity check against torch."""
    model = model.eval().float()
    example = torch.rand(2, 3, image_size, image_size)
    names: dict[str, Any] = {"input_names": [INPUT_NAME], "output_names": [OUTPUT_NAME]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # each exporter warns about the other
        try:
            batch_axis = {INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}}
            torch.onnx.export(model, (example,), str(path), dynamo=False, dynamic_axes=batch_axis, **names)
        except Exception:  # whatever the tracer cannot do: the dynamo exporter, whose error is then the one shown
            path.unlink(missing_ok=True)
            batch = torch.export.Dim("batch", min=1, max=65536)
            torch.onnx.export(model, (example,), str(path), dynamo=True, external_data=False,
                              dynamic_shapes=({0: batch},), verbose=False, **names)  # fmt: skip
    return path


def parity(
    reference: np.ndarray,
    candidate: np.ndarray,
    max_abs_diff: float,
    min_top1_agreement: float,
    max_rel_diff: float = 0.0,
) -> ParityResult:
    """Each image's logits within `max_abs_diff`, or within `max_rel_diff` of that image's largest |logit| where
    that is larger: fp32 rounding grows with the activations' scale (an efficientnet_b0 after one epoch has
    logits up to 334, and ONNX Runtime's kernels differ from oneDNN's by 4e-3 there: 1.3e-5 of the scale)."""
    ref = reference.astype(np.float64)
    diff = np.abs(ref - candidate.astype(np.float64)).max(axis=1)
    scale = np.abs(ref).max(axis=1)
    allowed = np.maximum(max_abs_diff, max_rel_diff * scale)
    rel = float((diff / np.maximum(scale, np.finfo(np.float64).tiny)).max())
    agree = float((reference.argmax(1) == candidate.argmax(1)).mean())
    passed = bool((diff <= allowed).all()) and agree >= min_top1_agreement
    return ParityResult(float(diff.max()), rel, agree, passed)
