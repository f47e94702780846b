"""Batch sizes that follow memory_gb: what one image costs, read off the network, and a real step's peak memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.architectures import nets
from pipeline.machine.memory_budget import GB, Budget, output_bytes_per_image


def _net(size: int) -> object:
    return nets.build("timm/resnet10t", [0.5] * 3, [0.25] * 3, size, num_classes=5)


def test_an_image_costs_the_square_of_its_size() -> None:
    model = _net(224)
    small, large = output_bytes_per_image(model, 112), output_bytes_per_image(model, 224)  # type: ignore[arg-type]
    assert large == pytest.approx(4 * small, rel=0.05)
    assert 10 * 2**20 < large < 200 * 2**20  # a residual network's layer outputs at 224 px: tens of MB


def test_batches_are_lowered_only_where_they_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.machine import memory_budget

    monkeypatch.setattr(memory_budget, "resident_bytes", lambda: 400 * 2**20)  # a fresh process, not this one
    model = _net(224)
    at_224 = Budget.of(2.0, model, 224)  # type: ignore[arg-type]
    assert at_224.eval_batch(4, "evaluate.batch_size") == 4
    lowered = at_224.eval_batch(4096, "evaluate.batch_size")
    assert 1 <= lowered < 4096 and (lowered % 8 == 0 or lowered < 8)
    split = at_224.micro_batch(4096, 5_000_000, "train.batch_size")
    assert 1 <= split < lowered  # a training step keeps more of each image than evaluation
    assert 1 <= at_224.calibration_batch(4096, "int8 calibration batch") < lowered  # and so does int8 calibration
    assert Budget.of(2.0, model, 32).eval_batch(512, "evaluate.batch_size") == 512  # type: ignore[arg-type]
    assert Budget.of(0, model, 224).micro_batch(4096, 5_000_000, "train.batch_size") == 4096  # type: ignore[arg-type]
    assert Budget.of(2.0, model, 224, "cuda").eval_batch(4096, "x") == 4096  # type: ignore[arg-type]


STEP = """
import json, sys, torch
from pipeline.architectures import nets
from pipeline.machine.memory_budget import Budget
from pipeline.training.engine import Engine, Loss, make_optimizer
torch.set_num_threads(1)
batch, budget_gb = int(sys.argv[1]), float(sys.argv[2])
model = nets.build("timm/resnet10t", [0.5] * 3, [0.25] * 3, 224, num_classes=5)
optim = make_optimizer(model, "adamw", 1e-3, 0.0)
images = torch.rand(batch, 3, 224, 224).contiguous(memory_format=torch.channels_last)
labels = torch.randint(0, 5, (batch,))
model.train()
# VmHWM: this interpreter's own peak (getrusage's ru_maxrss keeps the forking parent's across exec: a pytest worker)
peak = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
micro = Budget.of(budget_gb, model, 224).micro_batch(batch, nets.count_parameters(model), "train.batch_size")
Engine(model, optim, lambda s: 1e-3, Loss(), micro_batch=micro).step(0, images, labels, batch)
fitted = peak()
Engine(model, optim, lambda s: 1e-3, Loss(), micro_batch=0).step(1, images, labels, batch)  # then in one piece
print(json.dumps({"micro": micro, "fitted": fitted, "whole": peak()}))
"""


def test_a_224_px_training_step_stays_within_the_budget_that_a_whole_batch_exceeds() -> None:
    done = subprocess.run([sys.executable, "-c", STEP, "64", "1.5"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["micro"] < 64
    assert measured["fitted"] < 1.5 * GB < measured["whole"]  # the peak only grows: the fitted step came first


CALIBRATE = """
import json, sys, tempfile, numpy as np, torch
from pathlib import Path
from pipeline.architectures import nets
from pipeline.machine.memory_budget import Budget
from pipeline.optimize import export, quantize
torch.set_num_threads(1)
budget_gb = float(sys.argv[1])
model = nets.build("timm/resnet10t", [0.5] * 3, [0.25] * 3, 224, num_classes=5).eval()
images = np.random.default_rng(0).random((64, 3, 224, 224), dtype=np.float32)
peak = lambda: next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
with tempfile.TemporaryDirectory() as tmp:
    export.export_onnx(model, Path(tmp) / "fp32.onnx", 224)
    batch = Budget.of(budget_gb, model, 224).calibration_batch(len(images), "int8 calibration batch")
    quantize.quantize_onnx(Path(tmp) / "fp32.onnx", images, Path(tmp) / "fitted.onnx", batch_size=batch)
    fitted = peak()
    quantize.quantize_onnx(Path(tmp) / "fp32.onnx", images, Path(tmp) / "whole.onnx", batch_size=len(images))
    print(json.dumps({"batch": batch, "fitted": fitted, "whole": peak()}))
"""


def test_int8_calibration_at_224_px_stays_within_the_budget_that_a_whole_batch_exceeds() -> None:
    """ONNX Runtime's calibration holds every tensor of a batch: its batch follows memory_gb like evaluation's."""
    done = subprocess.run([sys.executable, "-c", CALIBRATE, "1.5"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["batch"] < 64
    assert measured["fitted"] < 1.5 * GB < measured["whole"]
