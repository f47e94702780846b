"""int8 post-training static quantization, calibrated on training images.

- PyTorch: torchao's pt2e flow (export -> prepare_pt2e -> calibrate -> convert_pt2e), with the quantizer of
  this machine's architecture: X86InductorQuantizer on x86-64, ArmInductorQuantizer on aarch64. The result
  is saved as a torch.export archive; torch.compile (Inductor) lowers it to int8 kernels.
- ONNX Runtime: quant_pre_process, then quantize_static in QDQ format, weights int8 per channel,
  activations uint8 per tensor.
"""

from __future__ import annotations

import platform
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pipeline.machine import ARM_MACHINES, X86_MACHINES, cpu_flags, has_native_bf16

__all__ = ["cpu_flags", "has_native_bf16"]


def needs_reduce_range(machine: str | None = None, flags: set[str] | None = None) -> bool:
    """x86 without VNNI: the AVX2 u8 x s8 kernels can saturate, so activations keep 7 bits."""
    machine = (machine or platform.machine()).lower()
    if machine not in X86_MACHINES:
        return False
    flags = cpu_flags() if flags is None else flags
    return not ({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def make_quantizer(machine: str | None = None, flags: set[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """(pt2e quantizer for `machine`, description). x86 without VNNI gets reduce_range (7-bit
    activations) to avoid the u8*s8 overflow of the AVX2 kernels, as torchao advises."""
    machine = (machine or platform.machine()).lower()
    if machine in ARM_MACHINES:
        from torchao.quantization.pt2e.quantizer.arm_inductor_quantizer import (
            ArmInductorQuantizer,
            get_default_arm_inductor_quantization_config,
        )

        arm = ArmInductorQuantizer()
        arm.set_global(get_default_arm_inductor_quantization_config())
        return arm, {"quantizer": "ArmInductorQuantizer", "reduce_range": False}
    if machine in X86_MACHINES:
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        reduce = needs_reduce_range(machine, flags)
        x86 = X86InductorQuantizer()
        x86.set_global(get_default_x86_inductor_quantization_config(reduce_range=reduce))
        return x86, {"quantizer": "X86InductorQuantizer", "reduce_range": reduce}
    raise ValueError(f"no pt2e int8 quantizer for machine {machine!r} (x86-64 and aarch64 are supported)")


CALIBRATION_BATCH = 64  # images per calibration forward (lowered to fit memory_gb: memory_budget)


def _batches(images: np.ndarray, batch_size: int) -> Iterator[np.ndarray]:
    for start in range(0, len(images), batch_size):
        yield images[start : start + batch_size]


def quantize_pt2e(
    model: nn.Module,
    calibration: np.ndarray,
    out: Path,
    machine: str | None = None,
    batch_size: int = CALIBRATION_BATCH,
) -> dict[str, Any]:
    """Quantize `model` (fp32, eval) with the calibration images (float32 NCHW) and save a .pt2."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer, info = make_quantizer(machine)
    model = model.eval().float()
    example = (torch.from_numpy(calibration[:2]),)
    batch = torch.export.Dim("batch", min=1, max=65536)
    exported = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    prepared = prepare_pt2e(exported.module(), quantizer)
    with torch.no_grad():
        for chunk in _batches(calibration, batch_size):
            prepared(torch.from_numpy(chunk))
    converted = drop_unused_attributes(convert_pt2e(prepared))
    program = torch.export.export(converted, example, dynamic_shapes=({0: batch},))
    torch.export.save(program, str(out))
    return info


def drop_unused_attributes(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Delete the parameters and buffers the graph no longer reads: after convert_pt2e the fp32
    weights stay on the module next to their int8 copies and would be saved (and loaded) with it."""
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    for name, _ in [*gm.named_parameters(), *gm.named_buffers()]:
        if name not in used:
            owner, _, attr = name.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, attr)
    return gm


QUANTIZED_OPS = ("Conv", "Gemm", "MatMul", "Relu", "Clip", "MaxPool")
"""The ONNX ops made int8 (with the Q/DQ pairs around them); everything else runs in fp32. `Clip` (ReLU6, as in
EfficientNet-Lite and MobileNet) folds into its convolution's output range: without it each convolution's
unbounded output was quantized before the clip, which cost the depthwise networks most of their int8 accuracy."""


class _Reader:
    """onnxruntime's CalibrationDataReader protocol over an array of images."""

    def __init__(self, input_name: str, images: np.ndarray, batch_size: int) -> None:
        self.input_name = input_name
        self._iter = _batches(images, batch_size)

    def get_next(self) -> dict[str, np.ndarray] | None:
        chunk = next(self._iter, None)
        return None if chunk is None else {self.input_name: np.ascontiguousarray(chunk)}


def quantize_onnx(
    fp32: Path,
    calibration: np.ndarray,
    out: Path,
    input_name: str = "images",
    batch_size: int = CALIBRATION_BATCH,
    reduce_range: bool | None = None,
) -> dict[str, Any]:
    """QDQ int8 copy of an fp32 ONNX model (per-channel int8 weights, uint8 activations, MinMax; only
    `QUANTIZED_OPS`).
    `reduce_range` (default: on x86 without VNNI) quantizes weights to 7 bits, which avoids the
    saturation of the AVX2 u8 x s8 kernels (on this project's 2-core AVX2 machines it cut the top-1 drop
    of a 2-epoch signnet from 3.3 to 0.8 points)."""
    reduce = needs_reduce_range() if reduce_range is None else reduce_range
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp:
        pre = Path(tmp) / "pre.onnx"
        try:
            quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=False)
        except TypeError:
            # ORT's symbolic shape inference (meant for transformers) trips over some ops, e.g. the
            # committee's ReduceLogSumExp; ONNX's own shape inference is enough for these CNNs.
            quant_pre_process(str(fp32), str(pre), skip_symbolic_shape=True)
        quantize_static(
            str(pre),
            str(out),
            _Reader(input_name, calibration, batch_size),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            reduce_range=reduce,
            # The network's own arithmetic (the per-image contrast normalisation's Sub/Div/Add/Mul, the committee's
            # vote) stays fp32: quantizing it too cost the default committee 9 validation images (0.19 points on
            # the gate's 4,635) at the same speed; with only these ops int8 it matched fp32 on all of them.
            op_types_to_quantize=list(QUANTIZED_OPS),
        )
    return {
        "quantizer": "onnxruntime quantize_static QDQ",
        "per_channel": True,
        "calibration": "minmax",
        "reduce_range": reduce,
        "quantized_ops": ",".join(QUANTIZED_OPS),
    }
