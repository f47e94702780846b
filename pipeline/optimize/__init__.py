"""The optimize stage: pruning, int8 quantization and ONNX export of the trained model (see stage.py)."""

from pipeline.config import Params


def run(params: Params) -> None:
    from pipeline.optimize.stage import run as run_stage

    run_stage(params)
