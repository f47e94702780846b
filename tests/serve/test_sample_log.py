"""serve.sample_log: what is kept (every unsure answer, a random share of the rest), the cap, the writer, the
review folder; and through a real server, the files byte for byte."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from pipeline.serve.sample_log import JSONL, SampleLog, review_folder
from tests.helpers.server import Server, start_server
from tests.serve.test_server import png

CLASSES = ["stop", "yield", "speed limit (30km/h)"]


def _probabilities(confidences: list[float]) -> np.ndarray:
    rows = []
    for c in confidences:
        rest = (1 - c) / 2
        rows.append([c, rest, rest])
    return np.asarray(rows, dtype=np.float32)


def _records(root: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(root.glob(f"*/{JSONL}")) for line in f.read_text().splitlines()]


def test_every_unsure_answer_and_a_random_share_of_the_rest_are_kept(tmp_path: Path) -> None:
    log = SampleLog(tmp_path / "log", rate=0.1, below_confidence=0.5, max_mb=10, version="abc", classes=CLASSES, seed=0)
    sure, unsure = [0.9] * 1000, [0.4] * 50
    files = [b"\x89PNG" + i.to_bytes(4, "big") for i in range(1050)]
    log.offer(files[:1000], [(32, 32)] * 1000, _probabilities(sure))
    log.offer(files[1000:], [(40, 30)] * 50, _probabilities(unsure))
    log.close()
    records = _records(tmp_path / "log")
    unsure_kept = [r for r in records if r["kept_because"] == "low confidence"]
    random_kept = [r for r in records if r["kept_because"] == "random sample"]
    assert len(unsure_kept) == 50 and 60 <= len(random_kept) <= 140  # 10 % of 1000, give or take
    for r in records:  # the file is there, byte for byte, under the server's own id
        data = (tmp_path / "log" / r["time"][:10] / r["file"]).read_bytes()
        assert data in files and r["file"] == f"{r['id']}.png" and r["model_version"] == "abc"
    assert unsure_kept[0]["top"][0] == {"class_id": 0, "name": "stop", "probability": 0.4}
    assert (unsure_kept[0]["width"], unsure_kept[0]["height"]) == (40, 30)


def test_the_folder_stops_growing_at_its_cap(tmp_path: Path) -> None:
    log = SampleLog(tmp_path / "log", rate=1.0, below_confidence=0.0, max_mb=0.05, version="abc", classes=CLASSES)
    big = b"\xff\xd8\xff" + bytes(10_000)
    log.offer([big] * 20, [(640, 480)] * 20, _probabilities([0.9] * 20))
    log.close()
    used = sum(p.stat().st_size for p in (tmp_path / "log").rglob("*") if p.is_file())
    cap = 0.05 * 1024 * 1024
    assert cap - len(big) - 1000 < used <= cap  # full: no room for one more
    assert log.kept == 5 and log.kept + log.dropped == 20
    assert all(r["file"].endswith(".jpg") for r in _records(tmp_path / "log"))


def test_the_review_folder_has_the_data_folder_layout_and_skips_a_cut_line(tmp_path: Path) -> None:
    log = SampleLog(tmp_path / "log", rate=1.0, below_confidence=0.5, max_mb=1, version="abc", classes=CLASSES)
    log.offer([b"\x89PNGa", b"\x89PNGb"], [(8, 8)] * 2, np.asarray([[0.1, 0.2, 0.7], [0.45, 0.1, 0.45]], np.float32))
    log.close()
    jsonl = next((tmp_path / "log").glob(f"*/{JSONL}"))
    with jsonl.open("a") as fh:
        fh.write('{"id": "cut sho')  # a kill mid-line
    counts = review_folder(tmp_path / "log", tmp_path / "review", below=0.5)
    assert counts == {"stop": 1}  # the 0.7 answer is above --below; the cut line is skipped
    assert [p.read_bytes() for p in (tmp_path / "review" / "stop").iterdir()] == [b"\x89PNGb"]
    counts = review_folder(tmp_path / "log", tmp_path / "review", below=1.0)
    assert counts == {"stop": 1, "speed limit (30km_h)": 1}  # no path separator from a class name


def test_a_real_server_logs_the_files_it_answered(models_dir: Path, tmp_path: Path) -> None:
    log_dir = tmp_path / "samples"
    server: Server = start_server(models_dir, tmp_path, {"sample_log": {"dir": str(log_dir), "rate": 1.0}})
    try:
        sent = [png(np.ascontiguousarray(image)) for image in server.test_images[:6]]
        files = [("files", (f"{i}.png", data, "image/png")) for i, data in enumerate(sent)]
        assert httpx.post(f"{server.url}/v1/predict", files=files).status_code == 200
        assert httpx.post(f"{server.url}/v1/predict", files={"files": ("x.png", b"junk")}).status_code == 400
    finally:
        server.stop()  # the writer flushes on shutdown
    records = _records(log_dir)
    assert len(records) == 6
    assert sorted((log_dir / r["time"][:10] / r["file"]).read_bytes() for r in records) == sorted(sent)
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "samples", str(log_dir), "--to", str(tmp_path / "review")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sum(1 for _ in (tmp_path / "review").rglob("*.png")) == 6 and "6 files in" in done.stdout
