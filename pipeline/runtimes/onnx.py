"""ONNX Runtime backend. Imports only numpy and onnxruntime: the server image has no torch."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.machine import usable_cpus
from pipeline.runtimes.base import ONNXRUNTIME, check_batch


class OnnxRuntime:
    name = ONNXRUNTIME

    def __init__(
        self, path: Path, variant: str, image_size: int, threads: int | None = None, spin: bool = True
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not spin:
            # Idle worker threads busy-wait by default: best for a benchmark loop, but in a server they
            # steal the cores that parse requests and decode images.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        usable = usable_cpus() if not threads else 0
        if usable and usable < (os.cpu_count() or 1):
            threads = usable  # ONNX Runtime's default counts the node's cores, past a quota or OMP_NUM_THREADS
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        self.variant = variant
        self.image_size = image_size
        self.path = path
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise ValueError(f"{path}: onnxruntime cannot load it ({type(exc).__name__}: {exc})") from None
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name

    def predict(self, images: np.ndarray) -> np.ndarray:
        batch = check_batch(images, self.image_size)
        (logits,) = self.session.run([self.output_name], {self.input_name: batch})
        return np.asarray(logits, dtype=np.float32)


def open_onnx(path: Path, fmt: str, variant: str, image_size: int, threads: int | None, spin: bool) -> OnnxRuntime:
    """The Opener of the table: ONNX Runtime's CPU provider."""
    return OnnxRuntime(path, variant, image_size, threads, spin)


def profile_onnx(path: Path, batch: np.ndarray, label: str, out: Path) -> None:
    """The Profiler of the table: ONNX Runtime's own profiler, 20 runs of `batch`, time per operator type."""
    import json

    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(out.parent / "ort_profile")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    for _ in range(20):
        session.run(None, {name: batch})
    trace = Path(session.end_profiling())
    totals: dict[str, list[float]] = {}
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            totals.setdefault(op, []).append(event["dur"])
    trace.unlink()
    grand = sum(sum(v) for v in totals.values()) or 1.0
    rows = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    text = [f"ONNX Runtime profile: {label}, 20 batches of 32", "", f"{'op':24} {'calls':>6} {'total ms':>10} {'%':>6}"]
    text += [f"{op:24} {len(d):6d} {sum(d) / 1000:10.2f} {100 * sum(d) / grand:6.1f}" for op, d in rows]
    out.write_text("\n".join(text) + "\n")
