"""The GPU check (scripts/gpu-check.sh, `python -m benchmarks gpu`): its logic on the CPU where no GPU is lent (a dry run of
the whole script, as CI runs it), and the real thing on CUDA where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu
from tests.helpers import REPO


def test_without_a_gpu_the_real_run_says_so_and_exits_2(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the real run is the gpu-marked test")
    assert gpu.main(["--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_the_table_rates_every_row_against_the_cpu_baseline_at_its_batch() -> None:
    report = {
        "dry_run": False, "device_name": "H100", "torch": "2.11", "cuda": "13.0", "cpu": "x86_64", "model": "m",
        "repeats": 3,
        "inference": [
            {"setup": gpu.BASELINE, "device": "cpu", "batch": 32, "images_per_s": 1000.0},
            {"setup": "cuda eager fp32", "device": "cuda", "batch": 32, "images_per_s": 25000.0},
            {"setup": "cuda graphs", "device": "cuda", "error": "RuntimeError: boom"},
            {"setup": "onnxruntime cuda", "skipped": "no CUDAExecutionProvider"},
        ],
        "training": [{"setup": "train step cuda bf16", "device": "cuda", "batch": 256, "images_per_s": 9000.0}],
    }  # fmt: skip
    table = gpu.table(report)
    assert "| cuda eager fp32 | cuda | 32 | 25,000 | 25.0x |" in table
    assert "RuntimeError: boom" in table and "no CUDAExecutionProvider" in table
    assert "DRY RUN" not in table


@pytest.mark.slow
def test_gpu_check_runs_to_the_end_on_the_cpu_in_dry_run_mode(tmp_path: Path, synthetic_gtsrb: Path) -> None:
    """The whole script, every stage and every row, on the CPU: it cannot rot where no GPU is lent."""
    # the synthetic GTSRB, always: this checks the script's logic; the real sample's figures come from the GPU run
    env = {**os.environ, "GTSRB_ROOT": str(synthetic_gtsrb), "PYTHON": sys.executable}
    out = tmp_path / "gpu-check"
    result = subprocess.run([str(REPO / "scripts/gpu-check.sh"), "--dry-run", str(out)], env=env, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text())
    assert report["dry_run"] is True
    setups = {row["setup"] for row in report["inference"] if "images_per_s" in row}
    assert {gpu.BASELINE, "cpu eager fp32", "cpu eager bf16", "cpu compiled"} <= setups
    assert all("error" not in row for row in report["inference"]), report["inference"]
    assert report["training"] and report["training"][0]["images_per_s"] > 0
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary and "served accuracy" in summary
    assert (out / "benchmark-table.md").is_file()


@pytest.mark.gpu
def test_every_cuda_row_runs_on_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    assert gpu.main(["--out", str(tmp_path), "--seconds", "0.2", "--repeats", "1", "--train-steps", "5"]) == 0
    report = json.loads((tmp_path / "gpu.json").read_text())
    rows = {row["setup"]: row for row in report["inference"]}
    for setup in ("cuda eager fp32", "cuda eager bf16", "cuda compiled", "cuda graphs"):
        assert "images_per_s" in rows[setup], rows[setup]
