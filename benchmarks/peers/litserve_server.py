"""LitServe 0.2 peer: a LitAPI with batching in the LitAPI (max_batch_size, batch_timeout), multipart upload on
/predict (field `file`); one inference worker, as LitServe recommends on CPU."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import litserve as ls
import numpy as np

from benchmarks.peers import decode, load


class SignAPI(ls.LitAPI):
    def __init__(self, models: Path, variant: str, threads: int, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout)
        self.models, self.variant, self.threads = models, variant, threads

    def setup(self, device: str) -> None:
        self.model = load(self.models, self.variant, self.threads)

    def decode_request(self, request) -> bytes:
        # No annotation on purpose: LitServe then passes the parsed form (multipart) instead of a JSON body.
        upload = request["file"]  # starlette UploadFile
        return upload.file.read()

    def batch(self, inputs: list[bytes]) -> list[bytes]:
        return inputs

    def predict(self, files: Any) -> np.ndarray:
        files = files if isinstance(files, list) else [files]
        return self.model.probabilities(decode(self.model, files))

    def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
        return list(output)

    def encode_response(self, output: np.ndarray) -> dict[str, Any]:
        return {"class_id": int(np.argmax(output)), "probability": float(np.max(output))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", type=Path, required=True)
    ap.add_argument("--variant", default="int8-onnx")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--batch-timeout", type=float, default=0.001)
    args = ap.parse_args()
    api = SignAPI(args.models, args.variant, args.threads, args.max_batch_size, args.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True)
    server.run(host="127.0.0.1", port=args.port, generate_client_file=False)


if __name__ == "__main__":
    main()
