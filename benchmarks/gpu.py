"""Inference and training on the GPU beside the CPU, measured side by side in one run (`scripts/gpu-check.sh`).

    uv run python -m benchmarks gpu --out reports/gpu                     # on a machine with CUDA
    uv run python -m benchmarks gpu --dry-run --out /tmp/gpu-dry          # everything on the CPU, small: the logic only

Rows (images/s at every batch size, best of `--repeats`):
  baseline             the model as PyTorch runs it by default on this machine's CPU (eager fp32)
  cuda eager fp32      the same on the GPU
  cuda eager bf16      under bf16 autocast
  cuda compiled        torch.compile (default mode; compile time reported apart)
  cuda graphs          torch.compile(mode="reduce-overhead"): CUDA graphs replay the whole forward
  onnxruntime cuda     the fp32 ONNX variant on ONNX Runtime's CUDA execution provider, when that provider exists
Training: images/s of the train stage's own step (Engine: forward, loss, backward, AdamW) on the GPU (bf16) vs the
CPU, on the prepared training split (or synthetic images). --dry-run runs every row on the CPU in place of the GPU
so the code cannot rot where no GPU is lent; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.architectures import nets
from pipeline.training.engine import Engine, Loss, make_optimizer

BATCH_SIZES = (1, 32, 256, 1024)
BASELINE = "baseline: cpu eager fp32"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def images_per_second(
    run: Callable[[torch.Tensor], object], batch: torch.Tensor, device: torch.device, seconds: float, repeats: int
) -> float:
    """Best of `repeats` timings of at least `seconds` each (a warm-up call first)."""
    run(batch)
    synchronize(device)
    best = 0.0
    for _ in range(repeats):
        calls, started = 0, time.perf_counter()
        while True:
            run(batch)
            calls += 1
            synchronize(device)
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
        best = max(best, calls * len(batch) / elapsed)
    return best


def load_model(models_dir: Path, image_size: int, classes: int) -> tuple[nn.Module, str, bool]:
    """The trained model when there is one, else a fresh default signnet (the figures are about speed); and
    whether it was the trained one."""
    path = models_dir / "model.pt"
    if path.exists():
        from pipeline.artifacts import model as model_file

        model, payload = model_file.read(path)
        return model.float().eval(), f"{path} ({payload['arch']['name']})", True
    torch.manual_seed(0)
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, image_size, width=32, num_classes=classes, members=2)
    return model.eval(), "a fresh signnet committee (no models/model.pt)", False


def inference_rows(
    model: nn.Module, image_size: int, device: torch.device, batch_sizes: list[int], seconds: float, repeats: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    cpu = torch.device("cpu")

    def add(setup: str, dev: torch.device, make: Callable[[], Callable[[torch.Tensor], object]]) -> None:
        started = time.perf_counter()
        try:
            run = make()
            setup_seconds = time.perf_counter() - started
            for size in batch_sizes:
                batch = torch.rand(size, 3, image_size, image_size, device=dev)
                with torch.inference_mode():
                    rate = images_per_second(run, batch, dev, seconds, repeats)
                rows.append({"setup": setup, "device": str(dev), "batch": size, "images_per_s": round(rate, 1),
                             "setup_seconds": round(setup_seconds, 2)})  # fmt: skip
        except Exception as exc:  # one failing setup is a row that says why, not a lost report
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            rows.append({"setup": setup, "device": str(dev), "error": f"{type(exc).__name__}: {first}"})

    on_cpu = model.to(cpu)
    add(BASELINE, cpu, lambda: on_cpu)
    on_device = model.to(device)

    def bf16() -> Callable[[torch.Tensor], object]:
        def run(x: torch.Tensor) -> object:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return on_device(x)

        return run

    add(f"{device.type} eager fp32", device, lambda: on_device)
    add(f"{device.type} eager bf16", device, bf16)
    add(f"{device.type} compiled", device, lambda: torch.compile(on_device))
    if device.type == "cuda":
        add("cuda graphs", device, lambda: torch.compile(on_device, mode="reduce-overhead"))
    return rows


def onnx_cuda_rows(
    models_dir: Path, image_size: int, batch_sizes: list[int], seconds: float, repeats: int
) -> list[dict[str, Any]]:
    """fp32-onnx on ONNX Runtime's CUDA execution provider, when this onnxruntime build has it."""
    import numpy as np
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return [{"setup": "onnxruntime cuda", "skipped": "this onnxruntime has no CUDAExecutionProvider"}]
    path = models_dir / "variants" / "fp32-onnx.onnx"
    if not path.exists():
        return [{"setup": "onnxruntime cuda", "skipped": f"{path} not found (run `pipeline optimize`)"}]
    session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    name = session.get_inputs()[0].name
    rows: list[dict[str, Any]] = []
    for size in batch_sizes:
        batch = np.random.default_rng(0).random((size, 3, image_size, image_size), dtype=np.float32)
        rate = images_per_second(lambda x: session.run(None, {name: x}), batch, torch.device("cpu"), seconds, repeats)  # type: ignore[arg-type]
        rows.append({"setup": "onnxruntime cuda", "device": "cuda", "batch": size, "images_per_s": round(rate, 1)})
    return rows


def training_rows(
    data: Path, device: torch.device, steps: int, batch: int, trained: nn.Module | None = None
) -> list[dict[str, Any]]:
    """The train stage's step (Engine, `train.amp: auto`'s precision on each device) on the GPU and on the CPU:
    images/s over `steps` steps after 3 warm-up steps. The network is a copy of the trained model when there is
    one (a torchvision or timm backbone measures as itself), else the default committee."""
    from pipeline.data.loader import load_split, to_float
    from pipeline.training.distributed import Dist, amp_dtype

    if (data / "manifest.json").exists():
        from pipeline.artifacts.prepared import read_manifest

        manifest = read_manifest(data)
        images = load_split("train", data).images[:batch]
        size, classes, mean, std = manifest.image_size, len(manifest.classes), manifest.mean, manifest.std
    else:
        size, classes, mean, std = 32, 43, [0.5] * 3, [0.25] * 3
        images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8)
    labels = torch.arange(len(images)) % classes
    rows: list[dict[str, Any]] = []
    for dev in dict.fromkeys([device, torch.device("cpu")]):
        torch.manual_seed(0)
        if trained is not None:
            model = copy.deepcopy(trained).float().train().to(dev)
        else:
            model = nets.build("signnet", mean, std, size, width=32, num_classes=classes, members=2).to(dev)
        optim = make_optimizer(model, "adamw", 0.003, 0.0005)
        dtype = amp_dtype("auto", dev)
        engine = Engine(model, optim, lambda s: 0.003, Loss(0.1), d=Dist(0, 1, dev), amp=dtype)
        x = to_float(images).to(dev)
        y = labels.to(dev)
        for s in range(3):
            engine.step(s, x, y, len(y))
        synchronize(dev)
        started = time.perf_counter()
        for s in range(steps):
            engine.step(3 + s, x, y, len(y))
        synchronize(dev)
        rate = steps * len(y) / (time.perf_counter() - started)
        rows.append({"setup": f"train step {dev.type}" + (" bf16" if dtype else " fp32"), "device": str(dev),
                     "batch": len(y), "images_per_s": round(rate, 1)})  # fmt: skip
    return rows


def table(report: dict[str, Any]) -> str:
    rows = report["inference"] + report["training"]
    cpu = {r["batch"]: r["images_per_s"] for r in rows if r.get("setup") == BASELINE and "images_per_s" in r}
    lines = [
        f"# GPU check: {report['device_name']} ({report['torch']}; CUDA {report['cuda']}), CPU {report['cpu']}",
        "",
        f"Model: {report['model']}. Images/s, best of {report['repeats']}; x CPU = against `cpu eager fp32` at the same "
        "batch, same run."
        + (" DRY RUN: every row ran on the CPU; the figures mean nothing." if report["dry_run"] else ""),
        "",
        "| setup | device | batch | images/s | x CPU eager |",
        "|---|---|---:|---:|---:|",
    ]
    for r in rows:
        if "images_per_s" in r:
            ratio = (
                f"{r['images_per_s'] / cpu[r['batch']]:.1f}x" if r["batch"] in cpu and "train" not in r["setup"] else ""
            )
            lines.append(f"| {r['setup']} | {r['device']} | {r['batch']} | {r['images_per_s']:,.0f} | {ratio} |")
        else:
            lines.append(f"| {r['setup']} | {r.get('device', '')} | | {r.get('error') or r.get('skipped')} | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("reports/gpu"))
    ap.add_argument("--models", type=Path, default=Path("models"))
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=30)
    ap.add_argument("--train-batch", type=int, default=256)
    ap.add_argument("--dry-run", action="store_true", help="run every row on the CPU, small (no GPU needed)")
    args = ap.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        args.batch_sizes, args.seconds, args.repeats = [32], 0.05, 1  # one shape: torch.compile compiles once
        args.train_steps, args.train_batch = 2, 32
    elif not torch.cuda.is_available():
        print(
            "bench gpu: no CUDA device here (torch.cuda.is_available() is False); --dry-run checks the logic on the CPU"
        )
        return 2
    else:
        device = torch.device("cuda")
    image_size = 32
    if (args.data / "manifest.json").exists():
        from pipeline.artifacts.prepared import read_manifest

        image_size = read_manifest(args.data).image_size
    model, described, trained = load_model(args.models, image_size, 43)
    report: dict[str, Any] = {
        "dry_run": args.dry_run,
        "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "none (dry run: CPU)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cpu": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        "model": described,
        "repeats": args.repeats,
        "inference": inference_rows(model, image_size, device, args.batch_sizes, args.seconds, args.repeats),
    }
    report["inference"] += onnx_cuda_rows(args.models, image_size, args.batch_sizes, args.seconds, args.repeats)
    report["training"] = training_rows(
        args.data, device, args.train_steps, args.train_batch, model if trained else None
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu.md").write_text(table(report))
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
