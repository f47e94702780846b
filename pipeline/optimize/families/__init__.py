"""The optimize stage's variant families, by name: one module each, one line in VARIANT_FAMILIES.

A module here exposes `wanted(cfg) -> bool` (whether `optimize.*` asks for the family) and
`make(maker, name, trained, payload, log) -> None` (the `Family` protocol): it makes its candidates, named from `name`
(its key here: the one place a family's name lives), through `maker.attempt` (or `maker.torch_family`: a torch file,
its ONNX export and its int8 ONNX), and the maker judges each by the gate, so a family never decides what ships. The
table's order is the order they are made: the trained model first, the reference every other variant is judged
against. docs/extending.md has the checklist.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from pipeline.artifacts.variants import TRAINED

if TYPE_CHECKING:
    from torch import nn

    from pipeline.config import OptimizeConfig
    from pipeline.optimize.candidates import VariantMaker

VARIANT_FAMILIES: dict[str, str] = {
    TRAINED: "pipeline.optimize.families.trained",  # the trained model, fp32-onnx, int8-onnx
    "int8-pt2e": "pipeline.optimize.families.pt2e",  # torchao's static int8, compiled
    "bf16": "pipeline.optimize.families.bf16",  # native bf16 CPUs (or optimize.bf16: on)
    "pruned": "pipeline.optimize.families.pruned",  # optimize.prune_amount > 0: pruned, its ONNX and int8 ONNX
    "student": "pipeline.optimize.families.student",  # optimize.student_width / student: a distilled network
}

MetricLogger = Callable[[dict[str, float], int], None]


class Family(Protocol):
    def wanted(self, cfg: OptimizeConfig) -> bool: ...

    def make(
        self, maker: VariantMaker, name: str, trained: nn.Module, payload: dict[str, Any], log: MetricLogger
    ) -> None: ...


def family(name: str) -> Family:
    """The module of a family in the table."""
    module: Family = importlib.import_module(VARIANT_FAMILIES[name])
    return module
