"""`pipeline predict PATH...`: classify image files with the served model, in this process (the same runtime,
framing and decode as the server: `serve.model.load_served_model` and `serve.protocol.decode_images`) or
through a running server (`--url`, /v1/predict). Files, folders (searched recursively for images) and globs.
Unreadable files are reported and counted, never a traceback; the exit code is non-zero when nothing could
be classified."""

from __future__ import annotations

import glob
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.artifacts import MODELS_DIR
from pipeline.config import Params
from pipeline.errors import StageError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".ppm", ".bmp", ".webp", ".gif"}


@dataclass
class Answer:
    path: str
    top_k: list[dict[str, Any]] = field(default_factory=list)  # class_id, name, probability; best first
    error: str = ""


def expand(paths: list[str]) -> list[Path]:
    """Files as given; folders searched recursively for image files; globs expanded. Sorted, no duplicates."""
    found: list[Path] = []
    for raw in paths:
        matches = [Path(m) for m in sorted(glob.glob(raw, recursive=True))] or [Path(raw)]
        for path in matches:
            if path.is_dir():
                found += sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            else:
                found.append(path)
    return list(dict.fromkeys(found))


def in_process(params: Params, files: list[Path], top_k: int, variant: str | None) -> list[Answer]:
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.serve.model import load_served_model
    from pipeline.serve.protocol import BadRequest, decode_images, top_classes

    config = params.serve if variant is None else params.serve.model_copy(update={"variant": variant})
    model = load_served_model(MODELS_DIR, config)
    answers, decoded, slots = [], [], []
    for path in files:
        answers.append(Answer(str(path)))
        try:
            decoded.append(decode_images([(path.read_bytes(), None)], model.framing, MAX_PIXELS))
            slots.append(len(answers) - 1)
        except BadRequest as exc:
            answers[-1].error = str(exc).removeprefix("image 0: ")
        except OSError as exc:
            answers[-1].error = f"cannot read: {exc.strerror or exc}"
    for start in range(0, len(decoded), 64):
        probabilities = model.probabilities(np.concatenate(decoded[start : start + 64]))
        for slot, best in zip(slots[start : start + 64], top_classes(probabilities, model.classes, top_k), strict=True):
            answers[slot].top_k = best
    return answers


def through_server(url: str, files: list[Path], top_k: int) -> list[Answer]:
    from pipeline.serve.client import http, multipart

    answers = []
    for path in files:
        answer = Answer(str(path))
        try:
            body, content_type = multipart([path.read_bytes()], path.suffix.lstrip(".").lower() or "png")
        except OSError as exc:
            answer.error = f"cannot read: {exc.strerror or exc}"
            answers.append(answer)
            continue
        status, _, reply = http("POST", f"{url.rstrip('/')}/v1/predict", body, {"Content-Type": content_type})
        if status == 200:
            answer.top_k = json.loads(reply)["predictions"][0]["top_k"][:top_k]
        elif 400 <= status < 500:
            answer.error = str(json.loads(reply).get("error", reply[:200])).removeprefix("image 0: ")
        else:
            raise StageError(f"{url}: HTTP {status} for {path}: {reply[:200]!r}")
        answers.append(answer)
    return answers


def run(params: Params, paths: list[str], url: str | None, variant: str | None, top_k: int, as_json: bool) -> int:
    files = expand(paths)
    if not files:
        raise StageError(f"no image files in {' '.join(paths)}")
    answers = through_server(url, files, top_k) if url else in_process(params, files, top_k, variant)
    failed = [a for a in answers if a.error]
    if as_json:
        for a in answers:
            sys.stdout.write(json.dumps({"file": a.path, "top_k": a.top_k, "error": a.error or None}) + "\n")
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table("file", "class", "probability", f"top {top_k}")
        for a in answers:
            if a.error:
                table.add_row(a.path, "[red]unreadable[/red]", "", a.error)
            else:
                best = a.top_k[0]
                rest = ", ".join(f"{t['class_id']} ({t['probability']:.2f})" for t in a.top_k[1:])
                table.add_row(a.path, f"{best['class_id']} {best['name']}", f"{best['probability']:.4f}", rest)
        Console().print(table)
    print(f"{len(answers) - len(failed)} classified, {len(failed)} unreadable", file=sys.stderr)
    return 0 if len(failed) < len(answers) else 1
