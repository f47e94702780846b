"""How close the served model runs to this CPU's arithmetic limit, measured side by side in one run.

    uv run python -m benchmarks roofline                       # models/ of the last `dvc repro`
    uv run python -m benchmarks roofline --model models/variants/fp32.pt --batch 32 --seconds 3

It counts the model's multiply-adds per image (hooks on every Conv2d and Linear), then measures, in
interleaved rounds keeping each case's best:
  sgemm             a large fp32 matrix multiply (torch.mm, the build's BLAS): what the cores can do
  torch eager       the fp32 model, oneDNN off (the benchmark stage's baseline) and on
  onnxruntime       the fp32 ONNX file (and int8, when present) at the same batch size
and prints each as images/s and GFLOP/s and as a fraction of sgemm's GFLOP/s. A runtime near 100 % of
sgemm cannot get much faster on this machine: only fewer operations (a smaller or pruned model) or
narrower arithmetic the CPU accelerates (int8 dot-product instructions such as VNNI, bf16) can.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from pipeline.runtimes.onnx import OnnxRuntime


def macs_per_image(model: nn.Module, size: int) -> int:
    """Multiply-adds of one forward pass over one image (nets.count_macs)."""
    return nets.count_macs(model, size)


def rate(fn: Callable[[], object], seconds: float) -> float:
    """Calls per second of `fn` over at least `seconds` (after two warm-up calls)."""
    fn()
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        calls += 1
    return calls / elapsed


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", category=UserWarning)  # torch's notices about oneDNN TF32 flags
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/variants/fp32.pt"))
    parser.add_argument("--onnx", type=Path, nargs="*", default=None, help="default: models/variants/*-onnx.onnx")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)
    if not args.model.is_file():
        sys.exit(f"{args.model}: no model; run the pipeline (dvc repro optimize) or pass --model")

    model, payload = model_file.read(args.model)
    size = int(payload["arch"]["image_size"])
    macs = macs_per_image(model, size)
    onnx_files = args.onnx if args.onnx is not None else sorted(args.model.parent.glob("*-onnx.onnx"))
    onnx_files = [p for p in onnx_files if not p.name.startswith("pruned")]
    images = torch.rand(args.batch, 3, size, size)
    batch_np = images.numpy()
    n = 2048
    a, b = torch.rand(n, n), torch.rand(n, n)

    def eager(onednn: bool) -> Callable[[], object]:
        def call() -> object:
            with torch.no_grad(), torch.backends.mkldnn.flags(enabled=onednn):
                return model(images)

        return call

    cases: dict[str, tuple[Callable[[], object], float]] = {  # name -> (call, FLOP per call)
        "sgemm 2048x2048 (torch.mm)": (lambda: torch.mm(a, b), 2.0 * n**3),
        "fp32 torch eager, oneDNN off": (eager(False), 2.0 * macs * args.batch),
        "fp32 torch eager, oneDNN on": (eager(True), 2.0 * macs * args.batch),
    }
    for path in onnx_files:
        runtime = OnnxRuntime(path, path.stem, size)
        cases[f"{path.stem} onnxruntime"] = (partial(runtime.predict, batch_np), 2.0 * macs * args.batch)

    best: dict[str, float] = {}
    for _ in range(args.rounds):  # interleaved: a burst of load on the shared machine hits every case
        for name, (call, _flop) in cases.items():
            best[name] = max(best.get(name, 0.0), rate(call, args.seconds))

    peak = best["sgemm 2048x2048 (torch.mm)"] * cases["sgemm 2048x2048 (torch.mm)"][1] / 1e9
    print(
        f"model: {args.model} ({macs / 1e6:.2f} M multiply-adds per image), batch {args.batch}, "
        f"{torch.get_num_threads()} threads"
    )
    print("| what | images/s | GFLOP/s | of sgemm |\n|---|---:|---:|---:|")
    results = []
    for name, (_call, flop) in cases.items():
        gflops = best[name] * flop / 1e9
        per_s = "-" if name.startswith("sgemm") else f"{best[name] * args.batch:,.0f}"
        print(f"| {name} | {per_s} | {gflops:.1f} | {gflops / peak:.0%} |")
        results.append({"case": name, "calls_per_s": best[name], "gflops": gflops, "of_sgemm": gflops / peak})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"macs_per_image": macs, "batch": args.batch, "results": results}, indent=2))


if __name__ == "__main__":
    main()
