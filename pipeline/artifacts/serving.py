"""models/serving.json: the benchmark stage's choice of what to serve (variant x backend), read by the server
(`serve.variant: auto`) and by containerize (`containerize.variant: auto`).

pydantic + stdlib only: the server image reads it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pipeline.artifacts import MODELS_DIR
from pipeline.artifacts._files import read_model, write_model
from pipeline.errors import StageError

SERVING_FILE = "serving.json"
SERVING_PATH = MODELS_DIR / SERVING_FILE


class ServingChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    variant: str
    backend: str
    setting: str = "default"
    threads: int = 0
    """Threads it was measured at (0 = all cores)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """What the benchmark measured for it (throughput, latency, accuracy)."""
    sha256: str = ""
    """SHA-256 of the variant file that was measured: a later optimize that replaced the file (same name,
    other model) makes this choice stale, and the server and containerize refuse it."""

    def check_against(self, variant_name: str, variant_sha256: str, models_dir: Path, setting: str) -> None:
        """A StageError when this choice was measured on another file than the manifest's `variant_name`."""
        if self.sha256 and variant_name == self.variant and variant_sha256 != self.sha256:
            raise StageError(
                f"{Path(models_dir) / SERVING_FILE} chose {self.variant} as measured on another file "
                f"(sha256 {self.sha256[:12]}, the manifest's is {variant_sha256[:12]}): the variants were rebuilt "
                f"after the benchmark. Run `pipeline benchmark` (or `dvc repro`), or set {setting} yourself"
            )


def write(choice: ServingChoice, models_dir: Path = MODELS_DIR) -> Path:
    return write_model(Path(models_dir) / SERVING_FILE, choice)


def missing_choice(models_dir: Path, setting: str) -> str:
    """The error when `auto` finds no choice: what happened and the two ways out."""
    return (
        f"{Path(models_dir) / SERVING_FILE} is missing: the benchmark stage has not chosen what to serve (or its "
        f"run was interrupted). Run `pipeline benchmark` (or `dvc repro`), or set {setting} to a variant of "
        f"{Path(models_dir) / 'manifest.json'} (e.g. fp32-onnx) to choose one yourself"
    )


def read(models_dir: Path = MODELS_DIR) -> ServingChoice | None:
    """The benchmark's choice; None when it has not run; a StageError when the file is not a choice."""
    path = Path(models_dir) / SERVING_FILE
    if not path.is_file():
        return None
    return read_model(path, ServingChoice, "rerun `pipeline benchmark`")
