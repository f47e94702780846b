"""BentoML 1.4 peer: a service with a batchable API (adaptive batching: max_batch_size, max_latency_ms) taking an
uploaded file (multipart field `files`) on /classify; one API worker per CPU (PEER_WORKERS overrides)."""

from __future__ import annotations

import os
from pathlib import Path

import bentoml
import numpy as np

from benchmarks.peers import decode, load
from pipeline.machine import usable_cpus

MODELS = Path(os.environ["PEER_MODELS"])
VARIANT = os.environ.get("PEER_VARIANT", "int8-onnx")
MAX_BATCH = int(os.environ.get("PEER_MAX_BATCH_SIZE", "64"))
# BentoML's recommended CPU setting: one API worker per CPU; each with its share of the runtime threads.
WORKERS = int(os.environ.get("PEER_WORKERS") or usable_cpus())
THREADS = int(os.environ.get("PEER_THREADS", "0")) or max(1, usable_cpus() // WORKERS)


@bentoml.service(workers=WORKERS, traffic={"timeout": 30})
class Signs:
    def __init__(self) -> None:
        self.model = load(MODELS, VARIANT, THREADS)

    @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=1000)
    def classify(self, files: list[Path]) -> list[dict[str, float]]:
        probabilities = self.model.probabilities(decode(self.model, [f.read_bytes() for f in files]))
        return [{"class_id": int(np.argmax(p)), "probability": float(np.max(p))} for p in probabilities]
