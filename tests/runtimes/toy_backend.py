"""ONNX Runtime with basic graph optimisations, run sequentially: a second backend for ONNX files.

The toy backend of tests/runtimes/test_registry.py: this one file and one line in RUNTIME_BACKENDS make a backend
(docs/extending.md). The tests add the line in place (importing this module from tests/) and, for the end-to-end
test, copy this file into a copy of the package as pipeline/runtimes/onnx_basic.py."""

from pathlib import Path

import numpy as np

from pipeline.runtimes.base import check_batch


class BasicOnnx:
    name = "onnxruntime-basic"

    def __init__(self, path: Path, variant: str, image_size: int, threads: int | None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if threads:
            options.intra_op_num_threads = threads
        self.variant, self.image_size = variant, image_size
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input_name = self.session.get_inputs()[0].name

    def predict(self, images: np.ndarray) -> np.ndarray:
        (logits,) = self.session.run(None, {self.input_name: check_batch(images, self.image_size)})
        return np.asarray(logits, dtype=np.float32)


def open_runtime(path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool) -> BasicOnnx:
    return BasicOnnx(path, variant, image_size, threads)
