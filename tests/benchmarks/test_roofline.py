"""`python -m benchmarks roofline`: its multiply-add counts and its report (seconds-long runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import roofline
from pipeline.architectures import nets
from pipeline.artifacts import model as model_file
from tests.helpers import REPO

MEAN, STD = [0.5] * 3, [0.25] * 3


def test_roofline_counts_the_multiply_adds_of_every_member() -> None:
    # signnet width 4 at 16 px: six 3x3 convolutions (4-4-8-8-16-16 filters at 16, 16, 8, 8, 4, 4 px) and
    # the 16 -> 43 classifier.
    convs = [(16, 4, 3), (16, 4, 4), (8, 8, 4), (8, 8, 8), (4, 16, 8), (4, 16, 16)]
    one = sum(side * side * filters * inputs * 9 for side, filters, inputs in convs) + 16 * 43
    for members in (1, 2):
        model = nets.build("signnet", MEAN, STD, 16, width=4, members=members)
        assert roofline.macs_per_image(model, 16) == members * one


def test_roofline_script_reports_every_case_against_sgemm(tmp_path: Path) -> None:
    model = nets.build("signnet", MEAN, STD, 16, width=4, members=2).eval()
    path = tmp_path / "fp32.pt"
    model_file.write_like(
        path, model, {"arch": nets.arch_kwargs("signnet", 16, 4, 0.2, members=2), "mean": MEAN, "std": STD}
    )
    out = tmp_path / "roofline.json"
    cmd = [sys.executable, "-m", "benchmarks", "roofline", "--model", str(path), "--onnx", "--batch", "4"]
    proc = subprocess.run(
        [*cmd, "--seconds", "0.05", "--rounds", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| sgemm 2048x2048 (torch.mm) | - |" in proc.stdout and "| 100% |" in proc.stdout
    report = json.loads(out.read_text())
    cases = {r["case"]: r for r in report["results"]}
    assert set(cases) == {"sgemm 2048x2048 (torch.mm)", "fp32 torch eager, oneDNN off", "fp32 torch eager, oneDNN on"}
    assert all(r["gflops"] > 0 and r["calls_per_s"] > 0 for r in cases.values())
    assert report["macs_per_image"] == roofline.macs_per_image(model, 16)


def test_roofline_script_names_a_missing_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "roofline", "--model", str(tmp_path / "none.pt")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "none.pt: no model" in proc.stderr and "Traceback" not in proc.stderr
