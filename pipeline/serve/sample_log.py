"""`serve.sample_log`: a sampled, size-capped log of what the server received and answered, for labelling.

Kept: every answered image file whose top-1 probability is at most `below_confidence`, and a random `rate` of the
others. Each kept file is written as sent (its bytes, its format) to DIR/<UTC date>/<id>.<ext>, with one JSON line
in DIR/<UTC date>/samples.jsonl: id, time, model version, width, height, the top classes with probabilities. The
request path only queues (a bounded queue; full = dropped and counted); one writer thread does the disk work. The
folder never grows past `max_mb`: at the cap the log stops keeping and says so once (delete or move what was
reviewed to make room). Nothing of a request decides a path: names are the server's own ids.

`pipeline samples` turns the log into a review folder: one sub-folder per answered class, the data-folder layout
(`data.source: folder`), so a person moves each file to its right class and adds the folder to the data set.
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LOG = logging.getLogger("pipeline.serve")
FORMATS = {b"\x89PNG": "png", b"\xff\xd8\xff": "jpg", b"GIF8": "gif", b"BM": "bmp", b"RIFF": "webp", b"P6": "ppm"}
JSONL = "samples.jsonl"


def extension(data: bytes) -> str:
    for magic, ext in FORMATS.items():
        if data.startswith(magic):
            return ext
    return "bin"


def folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


@dataclass
class Kept:
    data: bytes
    record: dict[str, Any]


class SampleLog:
    def __init__(
        self,
        root: Path,
        rate: float,
        below_confidence: float,
        max_mb: float,
        version: str,
        classes: list[str],
        queue_size: int = 1024,
        seed: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.rate, self.below, self.version, self.classes = rate, below_confidence, version, classes
        self.max_bytes = int(max_mb * 1024 * 1024)
        self.used = folder_bytes(self.root)
        self.full_logged = False
        self.kept = self.dropped = 0
        self.random = random.Random(seed)
        self.queue: queue.Queue[Kept | None] = queue.Queue(queue_size)
        self.writer = threading.Thread(target=self._write_all, name="sample-log", daemon=True)
        self.writer.start()

    def offer(self, files: list[bytes], sizes: list[tuple[int, int]], probabilities: np.ndarray) -> None:
        """Called once per answered request of image files; cheap unless an image is kept."""
        top = probabilities.max(axis=1)
        for i, confidence in enumerate(top.tolist()):
            if confidence > self.below and self.random.random() >= self.rate:
                continue
            order = np.argsort(-probabilities[i], kind="stable")[:3]
            record = {
                "id": uuid.uuid4().hex,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "model_version": self.version,
                "width": sizes[i][0],
                "height": sizes[i][1],
                "top": [{"class_id": int(c), "name": self.classes[int(c)], "probability": round(float(probabilities[i, c]), 6)} for c in order],
                "kept_because": "low confidence" if confidence <= self.below else "random sample",
            }  # fmt: skip
            try:
                self.queue.put_nowait(Kept(files[i], record))
            except queue.Full:
                self.dropped += 1

    def _write_all(self) -> None:
        while (item := self.queue.get()) is not None:
            try:
                self._write(item)
            except OSError as exc:  # a full disk must not take the server down
                self.dropped += 1
                LOG.warning("serve.sample_log: could not write a sample (%s)", exc)
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _write(self, item: Kept) -> None:
        name = f"{item.record['id']}.{extension(item.data)}"
        line = (json.dumps(item.record | {"file": name}) + "\n").encode()
        if self.used + len(item.data) + len(line) > self.max_bytes:
            self.dropped += 1
            if not self.full_logged:
                self.full_logged = True
                LOG.warning("serve.sample_log: %s reached serve.sample_log.max_mb; keeping nothing more", self.root)
            return
        day = self.root / item.record["time"][:10]
        day.mkdir(exist_ok=True)
        (day / name).write_bytes(item.data)
        with (day / JSONL).open("ab") as fh:
            fh.write(line)
        self.used += len(item.data) + len(line)
        self.kept += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (up to `timeout_s`), then stop the writer."""
        deadline = time.monotonic() + timeout_s
        while not self.queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()) or 0.01)
        except queue.Full:
            return
        self.writer.join(max(0.0, deadline - time.monotonic()))


def review_folder(log_dir: Path, out: Path, below: float = 1.0) -> dict[str, int]:
    """Copy the logged files whose top-1 probability is at most `below` into out/<answered class>/, the data-folder
    layout; returns how many per class. Files already there are left alone (runs can repeat)."""
    import shutil

    counts: dict[str, int] = {}
    for jsonl in sorted(Path(log_dir).glob(f"*/{JSONL}")):
        for line in jsonl.read_text().splitlines():
            try:
                record = json.loads(line)
                top = record["top"][0]
                source = jsonl.parent / record["file"]
            except (ValueError, KeyError, IndexError, TypeError):
                continue  # a line cut short by a kill: skipped
            if top["probability"] > below or not source.is_file() or "/" in record["file"]:
                continue
            name = "".join(ch if ch.isalnum() or ch in " ._-()" else "_" for ch in top["name"]).strip() or "unknown"
            target = Path(out) / name / source.name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
            counts[name] = counts.get(name, 0) + 1
    return counts
