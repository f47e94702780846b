"""KServe peer: the Python model server an InferenceService runs for a custom predictor (`kserve.Model` +
`kserve.ModelServer`, FastAPI on uvicorn), OIP v2 REST with BYTES inputs (encoded image files, base64 in JSON).
KServe's Python server has no dynamic batching of its own (its batcher is the Go agent sidecar that Kubernetes
injects), so each request is one model call; its settings for speed: the per-request latency log off, its logging
left unconfigured (`--configure_logging false`: no INFO line per request), gRPC off when unused, uvicorn workers up
to the cores (`--workers`)."""

from __future__ import annotations

import argparse
import base64
import os
from pathlib import Path
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer, model_server

from benchmarks.peers import decode, load


class Signs(Model):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.load()

    def load(self) -> bool:
        self.model = load(Path(os.environ["PEER_MODELS"]), os.environ.get("PEER_VARIANT", "int8-onnx"),
                          int(os.environ.get("PEER_THREADS", "0")))  # fmt: skip
        self.ready = True
        return True

    async def predict(self, payload: InferRequest, headers: Any = None, response_headers: Any = None) -> InferResponse:
        data = payload.inputs[0].data  # JSON BYTES elements: base64 strings, as our server takes them
        files = [item if isinstance(item, bytes) else base64.b64decode(item) for item in data]
        class_id = self.model.probabilities(decode(self.model, files)).argmax(axis=1).astype(np.int64)
        output = InferOutput(name="class_id", shape=[len(files)], datatype="INT64", data=class_id.tolist())
        return InferResponse(response_id=payload.id or "", model_name=self.name, infer_outputs=[output])


if __name__ == "__main__":
    args = argparse.ArgumentParser(parents=[model_server.parser]).parse_args()
    ModelServer(http_port=args.http_port, workers=args.workers, enable_grpc=False,
                enable_latency_logging=False).start([Signs(args.model_name)])  # fmt: skip
