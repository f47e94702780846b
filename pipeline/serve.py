"""The serve stage (skeleton: filled in by issue #6)."""

from pipeline.config import Params
from pipeline.errors import NotImplementedStage


def run(params: Params) -> None:
    raise NotImplementedStage("serve", "issue #6")
