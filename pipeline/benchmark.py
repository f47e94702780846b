"""The benchmark stage (skeleton: filled in by issue #5)."""

from pipeline.config import Params
from pipeline.errors import NotImplementedStage


def run(params: Params) -> None:
    raise NotImplementedStage("benchmark", "issue #5")
