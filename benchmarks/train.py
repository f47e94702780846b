"""Training throughput, measured side by side in one run (images/s; compare the ratios, not absolutes).

    uv run python -m benchmarks train                      # data/prepared if present, else synthetic
    uv run python -m benchmarks train --model trafficsignnet --steps 40 --out reports/bench_train.json
    uv run python -m benchmarks train --width 32 --members 2 --against-width 16   # this recipe vs the previous one

Measures, with the train stage's own pieces (loader, model, optimizer, DDP/FSDP wrapping):
  loader            the batch loader alone (gather + uint8->float + per-image augmentation)
  step              the training step alone on one prepared batch (forward, backward, optimizer)
  train eager       loader + step, 1 process with all cores: what `pipeline train` does by default
  train compile     the same through torch.compile (compile time reported separately, not in the rate)
  train bf16        the same under bf16 autocast
  train 2 procs     loader + step, DDP (and FSDP) over 2 processes with gloo, the cores split between them
  train against     with --against-width W: loader + step of the same committee at width W in fp32 (the previous
                    default recipe was width 16, fp32 on CPUs), interleaved with the rest
Each single-process case runs `--rounds` times, interleaved, and keeps its best rate (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.architectures import nets
from pipeline.artifacts.prepared import read_manifest
from pipeline.config import Params, parse_params
from pipeline.data.loader import AugmentConfig, Split, TrainLoader, load_split
from pipeline.training import distributed
from pipeline.training.distributed import Dist
from pipeline.training.engine import Engine, Loss, make_optimizer


@dataclass(frozen=True)
class Data:
    """What the network is built from: image size, classes, mean/std (artifacts.prepared's manifest has them)."""

    image_size: int
    classes: list[str]
    mean: list[float]
    std: list[float]


def synthetic(n: int = 4096, size: int = 32) -> tuple[Split, Data]:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=g).permute(0, 3, 1, 2)
    split = Split(images=images, labels=torch.randint(0, 43, (n,), generator=g))
    return split, Data(size, [str(i) for i in range(43)], [0.5] * 3, [0.25] * 3)


def get_data(path: Path) -> tuple[Split, Data, str]:
    if (path / "manifest.json").exists():
        m = read_manifest(path)
        return load_split("train", path), Data(m.image_size, m.classes, m.mean, m.std), str(path)
    split, data = synthetic()
    return split, data, "synthetic (4096 random 32x32 images)"


def build_model(params: Params, data: Data) -> torch.nn.Module:
    m = params.model
    arch = nets.arch_kwargs(m.name, data.image_size, m.width, m.dropout, len(data.classes), m.input_norm, m.members)
    return nets.build_from_arch(arch, data.mean, data.std)


def params_for(args: argparse.Namespace, width: int | None = None, **train: Any) -> Any:
    return parse_params(
        {
            "model": {"name": args.model, "width": width or args.width, "members": args.members},
            "train": {"batch_size": args.batch, **train},
            "tracking": {"enabled": False},
        }
    )


def time_loop(args: argparse.Namespace, split: Split, data: Data, mode: str, d: Dist) -> dict[str, float]:
    """Rate of `mode` (loader | step | train) for args.steps steps after args.warmup, on this rank: the train
    stage's loader, model, optimizer and training.engine step."""
    width = args.against_width if mode == "against" else None
    params = params_for(args, width, compile=mode == "compile", strategy=args.strategy_now)
    torch.manual_seed(0)
    model = distributed.wrap_model(build_model(params, data), params.train.strategy, d)
    t = params.train
    optim = make_optimizer(model, t.optimizer, t.lr, params.regularize.weight_decay)
    fn = torch.compile(model) if mode == "compile" else model
    engine = Engine(
        model,
        optim,
        lambda _step: t.lr,
        Loss(label_smoothing=params.regularize.label_smoothing),
        forward=fn,
        d=d,
        amp=torch.bfloat16 if mode == "bf16" else None,
    )
    loader = TrainLoader(split, args.batch, 0, d.rank, d.world, AugmentConfig.of(params.augment))
    batches = iter(loader)

    def next_batch() -> Any:
        nonlocal batches
        try:
            return next(batches)
        except StopIteration:
            batches = iter(loader)
            return next(batches)

    fixed = next_batch()
    compile_s = 0.0
    total = args.warmup + args.steps
    start = time.perf_counter()
    for i in range(total):
        if i == args.warmup:
            if d.world > 1:
                torch.distributed.barrier()
            compile_s = time.perf_counter() - start
            start = time.perf_counter()
        batch = fixed if mode == "step" else next_batch()
        if mode == "loader":
            continue
        engine.step(i, batch.images, batch.labels, batch.global_size)
    if d.world > 1:
        torch.distributed.barrier()
    elapsed = time.perf_counter() - start
    return {"images_per_s": args.steps * args.batch / elapsed, "warmup_s": compile_s}


def _rank_main(rank: int, world: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(max(1, args.threads // world))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        split, data, _ = get_data(args.data)
        result = time_loop(args, split, data, "train", Dist(rank, world, torch.device("cpu")))
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        torch.distributed.destroy_process_group()


def multi_process(args: argparse.Namespace, world: int, strategy: str) -> dict[str, float]:
    import torch.multiprocessing as mp

    port = distributed.free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        args.strategy_now = strategy
        mp.start_processes(_rank_main, args=(world, args, port, out), nprocs=world, start_method="spawn")
        args.strategy_now = "ddp"
        result: dict[str, float] = json.loads(Path(out).read_text())
        return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument(
        "--model", default="signnet", help="model.name: signnet, trafficsignnet, torchvision/<arch>, timm/<arch>"
    )
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--members", type=int, default=1, help="committee size (params.yaml's default is 2)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip", nargs="*", default=[], help="cases to leave out: compile bf16 ddp fsdp")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    ap.add_argument(
        "--against-width", type=int, default=0, help="also time the committee at this width in fp32 (previous: 16)"
    )
    ap.add_argument("--epochs", type=int, default=12, help="epochs for the projected training times")
    args = ap.parse_args(argv)
    args.strategy_now = "ddp"

    torch.set_num_threads(args.threads)
    split, data, source = get_data(args.data)
    d = Dist(0, 1, torch.device("cpu"))
    modes = ["loader", "step", "train"] + [m for m in ("compile", "bf16") if m not in args.skip]
    if args.against_width:
        modes.append("against")
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.rounds):
        for mode in modes:
            r = time_loop(args, split, data, mode, d)
            best = results.get(mode)
            if best is None or r["images_per_s"] > best["images_per_s"]:
                results[mode] = r
    for strategy in ("ddp", "fsdp"):
        if strategy not in args.skip:
            results[f"2proc_{strategy}"] = multi_process(args, 2, strategy)

    rate = {k: v["images_per_s"] for k, v in results.items()}
    ratios = {
        "loader_vs_train (loader alone / full step)": rate["loader"] / rate["train"],
        "loader_share_of_step_time": rate["train"] / rate["loader"],
        "step_vs_train (step alone / loader+step)": rate["step"] / rate["train"],
    }
    if "compile" in rate:
        ratios["compile_vs_eager"] = rate["compile"] / rate["train"]
    if "bf16" in rate:
        ratios["bf16_vs_fp32"] = rate["bf16"] / rate["train"]
    projected: dict[str, float] = {}
    if "against" in rate:
        # What the recipes cost per run: the chosen precision of this width against the other width in fp32.
        ours = rate["bf16"] if "bf16" in rate and distributed.amp_dtype("auto", torch.device("cpu")) else rate["train"]
        ratios["this_recipe_vs_against_width_fp32"] = ours / rate["against"]
        projected = {
            f"width {args.width}, train.amp auto": args.epochs * len(split) / ours,
            f"width {args.against_width}, fp32": args.epochs * len(split) / rate["against"],
        }
    for strategy in ("ddp", "fsdp"):
        if f"2proc_{strategy}" in rate:
            ratios[f"2proc_{strategy}_vs_1proc"] = rate[f"2proc_{strategy}"] / rate["train"]
    report = {
        "data": source,
        "model": args.model,
        "width": args.width,
        "members": args.members,
        "batch_size": args.batch,
        "threads": args.threads,
        "torch": torch.__version__,
        "images_per_s": {k: round(v, 1) for k, v in rate.items()},
        "compile_warmup_s": round(results["compile"]["warmup_s"], 1) if "compile" in results else None,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }
    if projected:
        report[f"projected_seconds_{args.epochs}_epochs_of_{len(split)}_images"] = {
            k: round(v, 1) for k, v in projected.items()
        }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
