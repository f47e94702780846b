"""reports/evaluate/gate.json: evaluate's verdict on the variant it measured, read by `pipeline serve`, containerize
and the release's image context (a variant is served only once this gate passed it), and by the model card.

pydantic + stdlib only: the server image reads it (the image carries the record of the variant it serves).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts import REPORTS_DIR
from pipeline.artifacts._files import read_model, write_model
from pipeline.errors import StageError

GATE_PATH = REPORTS_DIR / "evaluate" / "gate.json"


class GateCheck(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    """`floor` (evaluate.min_accuracy), `trained` (within max_drop of the trained model), `champion`."""
    passed: bool
    detail: str
    """One line with the figures compared."""


class Champion(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    """The registered model's version the `champion` alias pointed at before this run."""
    variant: str
    accuracy: float
    """Its accuracy on this run's test files (through its MLflow pyfunc model), beside this run's."""


class Gate(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    passed: bool
    variant: str
    sha256: str
    """The variant file the verdict is about: another file (a later optimize) is not gated."""
    accuracy: float
    trained_accuracy: float
    images: int
    checks: list[GateCheck] = Field(default_factory=list)
    champion: Champion | None = None
    """The champion it was compared with; None on a first run (or with evaluate.champion off)."""
    promoted_version: str = ""
    """The registry version the `champion` alias was moved to once this gate passed; empty when it was not."""
    not_promoted: str = ""
    """Why a passed gate left `champion` where it was (a pull request, a sweep, evaluate.promote never)."""

    def failures(self) -> str:
        return "; ".join(c.detail for c in self.checks if not c.passed)


def write(gate: Gate, path: Path = GATE_PATH) -> Path:
    return write_model(path, gate)


def read(path: Path = GATE_PATH) -> Gate:
    return read_model(path, Gate, "run `pipeline evaluate` first", "quality gate record")


def require_passed(variant: str, sha256: str, path: Path = GATE_PATH) -> Gate:
    """The gate record of this variant file, when it passed; else a StageError naming what failed (or that it was
    never gated)."""
    if not Path(path).is_file():
        raise StageError(
            f"{variant} has not been through evaluate's quality gate ({path} is missing): run `pipeline evaluate` "
            "(or `dvc repro evaluate`) first"
        )
    gate = read(path)
    if gate.variant != variant or gate.sha256 != sha256:
        raise StageError(
            f"{path} gated {gate.variant} (sha256 {gate.sha256[:12]}), not {variant} (sha256 {sha256[:12]}): run "
            "`pipeline evaluate` on what you serve"
        )
    if not gate.passed:
        raise StageError(f"{variant} failed evaluate's quality gate, so it is not served: {gate.failures()}")
    return gate
