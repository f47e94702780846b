"""The model behind the server: a variant from models/manifest.json opened through the shared runtime
interface (pipeline.runtimes, the same one the benchmark stage times), plus what the API needs to know."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pipeline.artifacts import model_card
from pipeline.artifacts import serving as serving_file
from pipeline.artifacts.drift_reference import DriftReference, read_for
from pipeline.artifacts.variants import MANIFEST_NAME
from pipeline.config import ServeConfig
from pipeline.errors import StageError
from pipeline.images.preprocess import Framing
from pipeline.machine import usable_cpus


@dataclass(frozen=True)
class RegistryVersion:
    """A registered model version, as the server reports it."""

    name: str
    """The registered model (tracking.registered_model_name)."""
    version: str
    """Its version number in the registry."""
    champion: bool
    """Whether the registry's `champion` alias points at it."""

    def describe(self) -> str:
        return f"registry version {self.version} of {self.name}" + (" (the champion)" if self.champion else "")

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ServedModel:
    classes: list[str]
    framing: Framing
    variant: str
    backend: str
    version: str
    predict_logits: Callable[[np.ndarray], np.ndarray]
    threads: int = 1
    """Intra-op threads of the runtime (serve.threads, else the container's CPU quota)."""
    card: str | None = None
    """The model card (Markdown) when one describes this variant: /v1/model-card."""
    drift_reference: DriftReference | None = None
    """The drift signals counted on the test files with this variant (evaluate): /v1/drift-reference."""
    registry: RegistryVersion | None = None
    """The registered version this file is, when the registry is there to say (`/v2/models/<name>`, the log)."""

    @property
    def image_size(self) -> int:
        return self.framing.size

    def probabilities(self, images: np.ndarray) -> np.ndarray:
        logits = self.predict_logits(images).astype(np.float32, copy=False)
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)


def choose_variant(models_dir: Path, config: ServeConfig) -> tuple[str, str]:
    """serve.variant/backend, or for `auto` the benchmark stage's choice; without one, a StageError rather
    than a guess (an interrupted benchmark must not make the server serve another variant silently)."""
    if config.variant != "auto":
        return config.variant, config.backend
    choice = serving_file.read(models_dir)
    if choice is None:
        raise StageError(serving_file.missing_choice(models_dir, "serve.variant"))
    from pipeline.artifacts.variants import read_manifest

    choice.check_against(
        choice.variant, read_manifest(models_dir).variant(choice.variant).sha256, models_dir, "serve.variant"
    )
    return choice.variant, choice.backend or config.backend


def load_served_model(models_dir: Path, config: ServeConfig) -> ServedModel:
    from pipeline.runtimes import open_runtime, read_manifest

    if not (models_dir / MANIFEST_NAME).is_file():
        raise StageError(
            f"no model to serve: {models_dir / MANIFEST_NAME} is missing; run the pipeline up to the "
            "optimize stage first (dvc repro optimize)"
        )
    manifest = read_manifest(models_dir)
    variant_name, backend = choose_variant(models_dir, config)
    variant = manifest.variant(variant_name)  # a StageError naming the shipped variants if unknown
    # Threads: serve.threads, else the CPUs the container may use (its cgroup quota, never the whole node's)
    # shared among the workers.
    # No spin-waiting: the server's own threads need the cores between batches.
    threads = config.threads or max(1, usable_cpus() // config.workers)
    runtime = open_runtime(models_dir, variant_name, backend=backend, threads=threads, spin=False)
    return ServedModel(
        classes=list(manifest.classes),
        framing=manifest.preprocess.framing(),
        variant=variant_name,
        backend=runtime.name,
        version=variant.sha256[:12],
        predict_logits=runtime.predict,
        threads=threads,
        card=model_card.read_markdown_for(variant_name, sha256=variant.sha256),
        drift_reference=current_reference(variant_name, variant.sha256[:12]),
    )


def current_reference(variant: str, version: str) -> DriftReference | None:
    """The evaluate stage's drift reference of exactly this file (a rebuilt variant's old reference is no
    reference: the server then has none, and says so at /v1/drift-reference)."""
    reference = read_for(variant)
    return reference if reference is not None and reference.model_version == version else None
