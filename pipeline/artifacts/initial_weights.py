"""models/weights.json: the weights train starts from, as the `weights` stage resolved them (the source, the file
and its sha256, the input scaling they expect). A DVC dependency of train: other weights (another file and
`model.weights_sha256`, a package upgrade in uv.lock) re-run train, and the same weights do not.

pydantic + stdlib only.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts._files import read_model, write_model

WEIGHTS_PATH = MODELS_DIR / "weights.json"


class InitialWeights(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    network: str
    """`model.name` they are for."""
    source: str
    """none | package | default | the file given | random (`auto` found none: `note` says why)."""
    file: str = ""
    """The file read (a package's, the library cache's, or yours)."""
    sha256: str = ""
    license: str = ""
    mean: list[float] = []
    """The input scaling the weights expect (per channel, on [0, 1] pixels); empty for networks of ours."""
    std: list[float] = []
    note: str = ""


def write(record: InitialWeights, path: Path = WEIGHTS_PATH) -> Path:
    return write_model(path, record)


def read(path: Path = WEIGHTS_PATH) -> InitialWeights:
    return read_model(path, InitialWeights, "run `pipeline weights` (or `dvc repro`) first", "initial weights record")
