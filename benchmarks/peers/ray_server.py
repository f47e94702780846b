"""Ray Serve peer: one deployment (one replica, the model in it) behind Ray Serve's HTTP proxy, multipart uploads,
with `@serve.batch` (max_batch_size --max-batch-size, batch_wait_timeout_s 1 ms) as Ray's docs recommend for
dynamic batching; max_ongoing_requests high enough that 64 connections reach the batcher. A local Ray cluster is
started by this process (its raylet, GCS and workers are its descendants, so their CPU counts as the server's)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve
from starlette.requests import Request

from benchmarks.peers import decode, load


def build(max_batch_size: int) -> Any:
    @serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
    class Signs:
        def __init__(self) -> None:
            self.model = load(Path(os.environ["PEER_MODELS"]), os.environ.get("PEER_VARIANT", "int8-onnx"),
                              int(os.environ.get("PEER_THREADS", "0")))  # fmt: skip

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=0.001)
        async def classify(self, files: list[bytes]) -> list[int]:
            probabilities = self.model.probabilities(decode(self.model, files))
            return [int(c) for c in probabilities.argmax(axis=1)]

        async def __call__(self, request: Request) -> dict[str, Any]:
            if request.method == "GET":  # readiness: answered only once the deployment serves
                return {"ready": True}
            form = await request.form()
            upload: Any = form["files"]
            return {"class_id": await self.classify(await upload.read())}

    return Signs.bind()  # type: ignore[attr-defined]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    args = parser.parse_args()
    ray.init(include_dashboard=False, num_cpus=os.cpu_count(), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build(args.max_batch_size), route_prefix="/predict")
    while True:
        time.sleep(3600)
