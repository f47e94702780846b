"""`pipeline predict`: in-process answers equal the server's for the same files; bad files counted, not fatal."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.config import parse_params
from pipeline.errors import StageError
from pipeline.serve import predict
from tests.helpers.server import Server, start_server


@pytest.fixture
def server(tiny_project: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    running = start_server(tiny_project / "models", tmp_path, {"max_body_bytes": 1024 * 1024})
    yield running
    running.stop()


def lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_predict_in_process_gives_the_servers_answers(
    tiny_project: Path, server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = parse_params(yaml.safe_load((tiny_project / "params.yaml").read_text()))
    originals = tiny_project / "data" / "prepared" / "test_files"
    folder = tmp_path / "mine"
    shutil.copytree(originals, folder / "nested")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n broken")
    (folder / "notes.txt").write_text("not an image: skipped by the folder search")
    with contextlib.chdir(tiny_project):
        assert predict.run(params, [str(folder)], None, "fp32-onnx", 3, True) == 0
        local = lines(capsys)
        assert predict.run(params, [str(folder)], server.url, None, 3, True) == 0
        remote = lines(capsys)
    count = len(list(originals.iterdir()))
    assert len(local) == len(remote) == count + 1  # the .txt is not an image file
    broken = [a for a in local if a["error"]]
    assert [Path(str(a["file"])).name for a in broken] == ["broken.png"]
    assert [a["error"] for a in remote if a["error"]] == [a["error"] for a in broken]
    for mine, theirs in zip(local, remote, strict=True):
        assert [t["class_id"] for t in mine["top_k"]] == [t["class_id"] for t in theirs["top_k"]]  # type: ignore[union-attr]
        for a, b in zip(mine["top_k"], theirs["top_k"], strict=True):  # type: ignore[arg-type]
            assert a["probability"] == pytest.approx(b["probability"], abs=1e-5)

    with contextlib.chdir(tiny_project):
        assert predict.run(params, [str(folder / "broken.png")], None, "fp32-onnx", 1, True) == 1  # nothing classified
        (tmp_path / "empty").mkdir()
        with pytest.raises(StageError, match="no image files"):
            predict.run(params, [str(tmp_path / "empty")], None, "fp32-onnx", 1, True)


# Orientation tag -> the transpose that stores an upright image so that a viewer applying the tag shows it upright
# (the inverse of ImageOps.exif_transpose's method for that tag).
_STORED_AS = {
    2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_90", 7: "TRANSVERSE",
    8: "ROTATE_270",
}  # fmt: skip


def _upright_and_rotated(sources: list[Path], upright: Path, rotated: Path) -> list[str]:
    """Each source image as an upright PNG and as a PNG whose pixels are stored turned, with the EXIF Orientation
    tag a phone writes (tags 2-8 in turn), in class folders a/ and b/; returns the relative names."""
    from PIL import Image

    names = []
    for i, source in enumerate(sources):
        name = f"{'ab'[i % 2]}/{i:03d}.png"
        tag = 2 + i % 7
        with Image.open(source) as image:
            pixels = image.convert("RGB")
        for folder in (upright, rotated):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pixels.save(upright / name)
        exif = Image.Exif()
        exif[0x0112] = tag
        pixels.transpose(getattr(Image.Transpose, _STORED_AS[tag])).save(rotated / name, exif=exif)
        names.append(name)
    return names


def test_a_photo_stored_rotated_is_the_same_image_in_prepare_predict_and_the_server(
    real_sample_test_files: list[Path],
    tiny_project: Path,
    server: Server,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Real sample images stored as phones store them (pixels turned, EXIF Orientation 2-8): prepare makes the same
    arrays as from the upright files, and `pipeline predict` and the server give the same answers for both."""
    from pipeline.artifacts.prepared import read_split
    from pipeline.stages import prepare

    sources = real_sample_test_files[:28]
    upright, rotated = tmp_path / "upright", tmp_path / "rotated"
    names = _upright_and_rotated(sources, upright, rotated)
    assert (upright / names[1]).read_bytes() != (rotated / names[1]).read_bytes()

    prepared = {}
    for folder in (upright, rotated):
        raw = yaml.safe_load((tiny_project / "params.yaml").read_text())
        raw["data"] = {**raw["data"], "source": "folder", "root": str(folder), "image_size": 24, "resize": "pad",
                       "crop": "none", "test_fraction": 0.25, "val_fraction": 0.2}  # fmt: skip
        raw["tracking"] = {"enabled": False}
        work = tmp_path / f"prepare-{folder.name}"
        work.mkdir()
        with contextlib.chdir(work):
            prepare.run(parse_params(raw))
        prepared[folder.name] = {s: read_split(s, work / "data/prepared").images for s in ("train", "val", "test")}
    for split in ("train", "val", "test"):
        assert len(prepared["upright"][split]) > 0
        assert (prepared["upright"][split] == prepared["rotated"][split]).all(), split

    params = parse_params(yaml.safe_load((tiny_project / "params.yaml").read_text()))
    answers = {}
    with contextlib.chdir(tiny_project):
        for folder in (upright, rotated):
            assert predict.run(params, [str(folder)], None, "fp32-onnx", 3, True) == 0
            local = lines(capsys)
            assert predict.run(params, [str(folder)], server.url, None, 3, True) == 0
            remote = lines(capsys)
            answers[folder.name] = [
                [(t["class_id"], round(t["probability"], 5)) for t in a["top_k"]]  # type: ignore[union-attr]
                for a in local + remote
            ]
    assert len(answers["upright"]) == 2 * len(names)
    assert answers["upright"] == answers["rotated"]
