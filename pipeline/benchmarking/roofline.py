"""The machine's fp32 multiply-add rate on a large matrix multiply: the per-variant table's roofline."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from pipeline.console import log

SGEMM_SIDE = 2048


def measure_sgemm(seconds: float = 1.0) -> dict[str, float]:
    """The machine's fp32 multiply-add rate (GMAC/s) on a large matrix multiply, all cores, by each library the
    runtimes use (torch.mm: the build's BLAS; ONNX Runtime's MatMul: MLAS). The faster is the roofline of the
    per-variant table: one library alone can understate what the cores do (docs/stages.md, benchmark). Measured in
    the stage's own process, after the setups: it has torch loaded for the machine facts and sets no switch a setup
    sets (threads, oneDNN, fast-math), so a fresh interpreter would measure the same and cost its start-up. Empty
    when it cannot be measured. `seconds` per library: benchmark.min_seconds, as for the setups."""
    try:
        return _sgemm_rates(seconds)
    except Exception as exc:  # a roofline is context, never a reason to fail the stage
        log(f"benchmark: roofline not measured ({type(exc).__name__}: {str(exc)[:200]})")
        return {}


def _best_rate(call: Any, seconds: float = 1.0, rounds: int = 3) -> float:
    """Calls per second of `call`, the best of `rounds` short runs (the machine is shared)."""
    call()
    best = 0.0
    for _ in range(rounds):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds / rounds or calls == 0:
            call()
            calls += 1
        best = max(best, calls / elapsed)
    return best


def _sgemm_rates(seconds: float) -> dict[str, float]:
    import torch

    n = SGEMM_SIDE
    a, b = torch.rand(n, n), torch.rand(n, n)
    rates = {"torch.mm": _best_rate(lambda: torch.mm(a, b), seconds) * n**3 / 1e9}
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper
    except ImportError:
        return rates
    tensor = partial(helper.make_tensor_value_info, elem_type=TensorProto.FLOAT, shape=[n, n])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "sgemm", [tensor("a"), tensor("b")], [tensor("c")]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {"a": a.numpy(), "b": b.numpy()}  # torch.rand is float32 already
    rates["onnxruntime MatMul"] = _best_rate(lambda: session.run(None, feed), seconds) * n**3 / 1e9
    return rates
