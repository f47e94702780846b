"""The containerize stage (skeleton: filled in by issue #7)."""

from pipeline.config import Params
from pipeline.errors import NotImplementedStage


def run(params: Params) -> None:
    raise NotImplementedStage("containerize", "issue #7")
