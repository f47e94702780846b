"""The deploy stage (skeleton: filled in by issue #7)."""

from pipeline.config import Params
from pipeline.errors import NotImplementedStage


def run(params: Params) -> None:
    raise NotImplementedStage("deploy", "issue #7")
