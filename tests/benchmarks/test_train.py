"""`python -m benchmarks train`: every case measured in one run, and the recipe comparison side by side."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import train as bench_train


def test_cases_and_the_side_by_side_recipe_comparison(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = "--width 8 --members 2 --against-width 4 --steps 2 --warmup 1 --rounds 1 --batch 16 --threads 1"
    # No prepared data at --data: synthetic images.
    bench_train.main([*args.split(), "--skip", "compile", "ddp", "fsdp", "--data", str(tmp_path), "--out", str(out)])
    report = json.loads(out.read_text())
    rates = report["images_per_s"]
    assert {"loader", "step", "train", "bf16", "against"} <= set(rates) and all(v > 0 for v in rates.values())
    ratio = report["ratios"]["this_recipe_vs_against_width_fp32"]
    projected = report["projected_seconds_12_epochs_of_4096_images"]
    ours, previous = projected["width 8, train.amp auto"], projected["width 4, fp32"]
    assert abs(ratio - previous / ours) < 0.05 * ratio  # the projection is the measured ratio, rounded
