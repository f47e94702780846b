"""MLServer 1.7 peer: a custom runtime (MLModel) taking OIP v2 BYTES (encoded image files, base64 in JSON), with
MLServer's adaptive batching (max_batch_size, max_batch_time in model-settings.json) and parallel_workers 0
(inference in the server process: its docs' setting for a model that is cheap per call)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from benchmarks.peers import decode, load


class SignRuntime(MLModel):
    async def load(self) -> bool:
        self.model = load(Path(os.environ["PEER_MODELS"]), os.environ.get("PEER_VARIANT", "int8-onnx"),
                          int(os.environ.get("PEER_THREADS", "0")))  # fmt: skip
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        # BYTES elements: in JSON base64 strings (as our server takes them), decoded here
        files = [item if isinstance(item, bytes) else base64.b64decode(item) for item in payload.inputs[0].data]
        probabilities = self.model.probabilities(decode(self.model, files))
        class_id = probabilities.argmax(axis=1).astype(np.int64)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output("class_id", class_id)],
        )
