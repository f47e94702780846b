"""`python -m benchmarks formats`: the prepared shards against LitData, MDS and WebDataset, every image read once."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks import formats
from tests.helpers.prepared import write_prepared

ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = ["litdata==0.2.76", "mosaicml-streaming==0.13.0", "webdataset==1.0.2"]


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    return write_prepared(tmp_path, sizes=(300, 43, 43), image_size=16)


def test_the_shards_read_a_shuffled_epoch_each_image_once(prepared: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "figures.json"
    assert formats.main([str(prepared), "--formats", "npy", "--rows", "250", "--rounds", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "250 images, shuffled" in printed and "npy" in printed
    figures = json.loads(out.read_text())["npy"]
    assert len(figures["rates"]) == 2 and min(figures["rates"]) > 0
    assert 0 < max(figures["rss"]) < 2048


def _replayed(batches: Iterator, twice: bool = False, wrong_label: bool = False) -> Iterator:
    for idx, images, labels in batches:
        if wrong_label:
            labels = (labels + 1) % 43
        yield idx, images, labels
        if twice:
            yield idx, images, labels
            twice = False


@pytest.mark.parametrize(("fault", "message"), [("twice", "came twice"), ("wrong_label", "labels do not match")])
def test_a_reader_that_repeats_or_mislabels_fails_the_run(
    prepared: Path, monkeypatch: pytest.MonkeyPatch, fault: str, message: str
) -> None:
    real = formats._batches
    monkeypatch.setattr(formats, "_batches", lambda *a: _replayed(real(*a), **{fault: True}))
    with pytest.raises(SystemExit, match=message):
        formats.read_epoch("npy", prepared, 200, prepared)


def test_a_missing_library_is_one_line_not_a_traceback(prepared: Path, capsys) -> None:
    if importlib.util.find_spec("litdata") is not None:
        pytest.skip("litdata is installed here")
    assert formats.main([str(prepared), "--formats", "npy", "litdata"]) == 2
    assert "not installed: litdata" in capsys.readouterr().out


@pytest.mark.slow
def test_every_format_through_the_libraries_themselves(prepared: Path, tmp_path: Path) -> None:
    """The command the docs name, with the three libraries brought by uv for the run (PyPI only)."""
    uv = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    if not Path(uv).exists():
        pytest.fail("uv is neither on PATH nor in .tools/bin (make env installs it)")
    command = [uv, "run", "--frozen"]
    for library in LIBRARIES:
        command += ["--with", library]
    out = tmp_path / "figures.json"
    command += ["-m", "benchmarks", "formats", str(prepared), "--rows", "200", "--rounds", "1", "--json", str(out)]
    # Bytecode written: each format's reader is a fresh process that imports its library (mosaicml-streaming brings
    # transformers) again, which without it is compiled from source each time (docs/ci.md has the cost).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures) == set(formats.FORMATS)
    for fmt, f in figures.items():
        assert min(f["rates"]) > 0, fmt
        if fmt != "npy":
            assert f["mb"] > 200 * 16 * 16 * 3 / 1e6, fmt  # every image was written
    assert np.isfinite(figures["litdata"]["write_s"])
