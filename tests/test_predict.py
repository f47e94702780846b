"""`pipeline predict`: in-process answers equal the server's for the same files; bad files counted, not fatal."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline import predict
from pipeline.config import parse_params
from pipeline.errors import StageError
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
