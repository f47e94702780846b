"""The optimize stage (skeleton: filled in by issue #4)."""

from pipeline.config import Params
from pipeline.errors import NotImplementedStage


def run(params: Params) -> None:
    raise NotImplementedStage("optimize", "issue #4")
