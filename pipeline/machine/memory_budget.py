"""Batch sizes that keep a stage within `memory_gb` of resident memory on the CPU.

A batch's memory grows with the image size squared: a batch that is nothing at 32 px can need gigabytes at 224 px.
What one image costs is read off the network itself (a one-image forward with hooks sums what every layer outputs),
times a factor measured on real networks (docs/own-data.md); the fixed part is this process's resident memory now
plus, when training, the gradients and the optimizer's two moments. Evaluation batches are lowered to fit; a training
batch keeps its size (the optimisation, and so the result, are the same) and is split into micro-batches whose
gradients add up. On CUDA the activations live on the device, so nothing is lowered there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from pipeline import console

GB = 1024**3
# Resident bytes per image over the sum of every layer's fp32 output for one image: the measured slope of peak RSS
# between two batch sizes, with a margin over the largest network's (docs/own-data.md has the measurements).
TRAIN_FACTOR = 1.3
EVAL_FACTOR = 0.4
# ONNX Runtime's MinMax calibration holds every tensor of a batch until the batch is done (each feeds a min and a max
# output): its slope is above a training step's.
CALIBRATE_FACTOR = 1.6
# The optimizer's per-parameter state when training: the gradient and AdamW's two moments.
TRAIN_STATE_PER_PARAMETER = 3
# What a first backward adds beyond the layer outputs (kernel scratch, the allocator's arenas): the intercept of
# peak RSS over batch size sits this far above the resident memory before the step.
STEP_OVERHEAD_BYTES = 384 * 2**20


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@torch.no_grad()
def output_bytes_per_image(model: nn.Module, image_size: int, channels: int = 3) -> int:
    """The sum over every leaf layer of its fp32 output's bytes for one image of `image_size` px."""
    total = 0

    def count(_module: nn.Module, _inputs: object, output: object) -> None:
        nonlocal total
        for tensor in output if isinstance(output, tuple | list) else (output,):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * 4

    leaves = [m for m in model.modules() if not list(m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    was_training = model.training
    model.eval()  # same shapes as training, without moving BatchNorm's running statistics
    try:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        model(torch.zeros(1, channels, image_size, image_size, device=device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return total


@dataclass(frozen=True)
class Budget:
    """What a stage may hold resident, and what one image costs in it."""

    limit_bytes: int
    """memory_gb in bytes; 0 = no limit."""
    per_image_bytes: int
    """One image's layer outputs (output_bytes_per_image)."""

    @classmethod
    def of(cls, memory_gb: float, model: nn.Module, image_size: int, device: torch.device | str = "cpu") -> Budget:
        if memory_gb <= 0 or torch.device(device).type == "cuda":
            return cls(0, 0)
        return cls(int(memory_gb * GB), output_bytes_per_image(model, image_size))

    def _fits(self, factor: float, fixed: int) -> int:
        per_image = max(1, int(self.per_image_bytes * factor))
        return max(1, (self.limit_bytes - fixed) // per_image)

    def eval_batch(self, requested: int, what: str, say: bool = True, factor: float = EVAL_FACTOR) -> int:
        """`requested`, or the largest batch under the limit (said once in the log)."""
        if not self.limit_bytes:
            return requested
        fits = _round_down(self._fits(factor, resident_bytes()))
        if fits >= requested:
            return requested
        if say:
            console.log(f"{what} {requested} -> {fits}: a batch of {requested} would not fit in memory_gb {self.gb}")
        return fits

    def calibration_batch(self, requested: int, what: str) -> int:
        """`requested`, or the largest int8 calibration batch under the limit."""
        return self.eval_batch(requested, what, factor=CALIBRATE_FACTOR)

    def micro_batch(self, batch: int, parameters: int, what: str, say: bool = True) -> int:
        """The largest part of a training batch of `batch` whose step fits under the limit (`batch` when it does)."""
        if not self.limit_bytes:
            return batch
        fixed = resident_bytes() + STEP_OVERHEAD_BYTES + parameters * 4 * TRAIN_STATE_PER_PARAMETER
        fits = _round_down(self._fits(TRAIN_FACTOR, fixed))
        if fits >= batch:
            return batch
        if say:
            console.log(
                f"{what} {batch} is stepped as micro-batches of {fits} whose gradients add up (the same update; a "
                f"batch of {batch} would not fit in memory_gb {self.gb})"
            )
        return fits

    @property
    def gb(self) -> str:
        return f"{self.limit_bytes / GB:g}"


def _round_down(n: int) -> int:
    """To a multiple of 8 above 8 (vectorised kernels like them), at least 1."""
    return n - n % 8 if n > 8 else max(1, n)
