"""`python -m benchmarks decode`: libspng and PIL side by side on the server's own decode path, the same tensor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from benchmarks import decode
from pipeline.images import preprocess


def test_both_decoders_timed_side_by_side_give_the_same_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if preprocess.pyspng is None:
        pytest.skip("pyspng is not installed")
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)).save(tmp_path / f"{i}.ppm")
    assert decode.main([str(tmp_path), "--size", "16", "--repeats", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["images"] == 12 and report["identical"] is True
    assert report["us_per_image"]["libspng"] > 0 and report["us_per_image"]["pil"] > 0
    assert preprocess.pyspng is not None  # restored after the PIL half
