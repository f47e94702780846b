"""One row per network on a folder of your images: `dvc repro evaluate` in a fresh copy of this project per network,
only params changed, then the figures the stages wrote (training time, served accuracy on the held-out original
files, the served variant, its b32 img/s against PyTorch's default eager measured side by side, its size).

    uv run python -m benchmarks models DATA_FOLDER --size 160 --epochs 5 --backends onnxruntime,torch-eager \\
        --model torchvision/mobilenet_v3_small --model torchvision/resnet18 --model timm/resnet10t

DATA_FOLDER is a `data.source: folder` layout (class folders, or train/ and test/ with class folders), or with
--source gtsrb a folder holding torchvision's gtsrb/ (the sample: --resize stretch, the demo's augmentation). Prints a
Markdown table and writes OUT/results.json (OUT: --out, default .own-models/). Long: every stage runs for real.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def project(out: Path, name: str) -> Path:
    work = out / name.replace("/", "-")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    for file in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(REPO / file, work / file)
    shutil.copytree(REPO / "pipeline", work / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=work, check=True)
    return work


def configure(work: Path, args: argparse.Namespace, name: str) -> None:
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["data"].update({"source": args.source, "root": str(Path(args.data).resolve()), "download": False,
                           "image_size": args.size, "resize": args.resize})  # fmt: skip
    params["model"].update({"name": name, "members": 1, "weights": "none"})

    params["train"].update({"epochs": args.epochs, "batch_size": 64, "checkpoint_every": 0, "lr": args.lr})
    params["augment"].update({"hflip": True, "random_resized_crop": 0.5, "rotation": 0.0, "shear": 0.0})
    if args.source == "gtsrb":  # signs: the demo's augmentation (no flips, no crops that cut the sign)
        params["augment"] = yaml.safe_load((REPO / "params.yaml").read_text())["augment"]
    params["evaluate"]["min_accuracy"] = 0.0
    params["optimize"].update({"finetune_epochs": args.finetune_epochs, "calibration_images": 256})
    if args.prune_amount is not None:  # optimize.prune_amount: more filters off where the fine-tune wins them back
        params["optimize"]["prune_amount"] = args.prune_amount
    params["benchmark"].update({"batch_sizes": [32], "min_seconds": 0.5, "latency_calls": 30, "profile": False})
    if args.backends:  # e.g. onnxruntime,torch-eager: the served runtime and PyTorch's default, side by side
        params["benchmark"]["backends"] = args.backends.split(",")
    params["tracking"]["enabled"] = False
    (work / "params.yaml").write_text(yaml.safe_dump(params))


def row(work: Path, name: str, wall: float) -> dict[str, object]:
    def read(path: str) -> dict[str, Any]:
        return json.loads((work / path).read_text())

    trained, bench, evaluation = (
        read("reports/train/metrics.json"),
        read("reports/benchmark/metrics.json"),
        read("reports/evaluate/metrics.json"),
    )
    manifest = read("models/manifest.json")
    variant = str(evaluation["variant"])
    size = next(v["size_bytes"] for v in manifest["variants"] if v["name"] == variant)
    return {
        "model": name,
        "train_seconds": round(float(trained["train_seconds"]), 1),
        "served_accuracy": evaluation["accuracy"],
        "trained_accuracy": evaluation.get("trained_accuracy"),
        "test_files": evaluation["images"],
        "served": bench["served"],
        "served_b32_img_s": bench["served_throughput_b32"],
        "x_default_eager": bench["speedup_b32_vs_default_eager"],
        "size_mb": round(float(size) / 1e6, 2),
        "wall_seconds": round(wall, 1),
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data")
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--resize", default="pad")
    ap.add_argument("--source", default="folder", choices=["folder", "gtsrb"], help="gtsrb: DATA holds gtsrb/")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--finetune-epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--prune-amount", type=float, default=None, help="optimize.prune_amount (default: params.yaml's)")
    ap.add_argument("--out", default=".own-models")
    ap.add_argument("--backends", default="", help="benchmark.backends, comma-separated (default: every one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out).resolve()
    rows = []
    for name in args.model:
        work = project(out, name)
        configure(work, args, name)
        started = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k not in ("GTSRB_ROOT", "MLFLOW_TRACKING_URI")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the `pipeline` command
        result = subprocess.run([sys.executable, "-m", "dvc", "repro", "evaluate"], cwd=work, env=env,
                                capture_output=True, text=True)  # fmt: skip
        (work / "repro.log").write_text(result.stdout + result.stderr)
        if result.returncode != 0:
            print(f"{name}: dvc repro failed, see {work / 'repro.log'}", file=sys.stderr)
            continue
        rows.append(row(work, name, time.perf_counter() - started))
        print(json.dumps(rows[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| network | training | served accuracy (trained) | served variant | b32 img/s | x default eager | size |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| `{r['model']}` | {r['train_seconds']:.0f} s | {r['served_accuracy']:.4f} ({r['trained_accuracy']:.4f}) "
            f"| {r['served']} | {r['served_b32_img_s']:,.0f} | {r['x_default_eager']:.2f}x | {r['size_mb']} MB |"
        )

    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
