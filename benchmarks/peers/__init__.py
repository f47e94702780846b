"""Peer servers for `python -m benchmarks serve --peers PYTHON`: LitServe, MLServer, BentoML, KServe and Ray Serve, each
serving the same model file through the same code as our server (pipeline.serve.model.load_served_model: ONNX Runtime session,
threads, framing; pipeline.serve.protocol.decode_images: decode + crop + resize), configured as their docs
recommend for dynamic batching. They run in an environment of their own (the peers pin their own dependencies):

    uv venv .venv-peers && uv pip install --python .venv-peers litserve mlserver bentoml kserve 'ray[serve]' \\
        onnxruntime pillow pyspng numpy pydantic pyyaml orjson python-multipart typer rich prometheus-client packaging

(pyspng: without it our decoding code falls back to PIL for PNGs in the peers' processes, not in ours.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.serve.model import ServedModel

MAX_PIXELS = 16_777_216


def load(models: Path, variant: str, threads: int) -> ServedModel:
    """Our served model (ONNX Runtime, no spin-waiting, the same threads) and its framing."""
    from pipeline.config import ServeConfig
    from pipeline.serve.model import load_served_model

    return load_served_model(models, ServeConfig(variant=variant, backend="onnxruntime", threads=threads))


def decode(model: ServedModel, files: list[bytes]) -> np.ndarray:
    from pipeline.serve.protocol import decode_images

    return decode_images([(data, None) for data in files], model.framing, MAX_PIXELS)
