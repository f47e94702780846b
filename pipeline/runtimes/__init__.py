"""Run any shipped model variant: `open_runtime(models_dir, variant, backend)` -> Runtime.predict.

The optimize stage evaluates its variants through this module, the benchmark stage times them with it
and the server serves with it, so all three run the same code. The ONNX Runtime backend needs only numpy
and onnxruntime; the torch backends import torch when they are opened.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

from pipeline.artifacts.checksum import sha256_of
from pipeline.artifacts.variants import ModelManifest, Variant, read_manifest
from pipeline.errors import StageError
from pipeline.runtimes.base import ONNXRUNTIME, TORCH_COMPILE, TORCH_EAGER, Backend, Opener, Runtime

# Every backend: one module with an Opener each, one line here (docs/extending.md). Order is preference: a variant
# made by optimize lists the backends that open its format in this order, `auto` serves it on the first, and optimize
# evaluates it on the first. Nothing outside this package names a backend: the stages ask its record (base.Backend).
_TORCH_FILES = ("torch-state-dict", "torch-export")
_TORCH_PACKAGES = ("torch", "torchao")
RUNTIME_BACKENDS: dict[str, Backend] = {
    ONNXRUNTIME: Backend(
        ("onnx",),
        "pipeline.runtimes.onnx:open_onnx",
        ("onnxruntime",),
        image=True,
        profiler="pipeline.runtimes.onnx:profile_onnx",
    ),
    TORCH_EAGER: Backend(
        _TORCH_FILES,
        "pipeline.runtimes.torch_backend:open_eager",
        _TORCH_PACKAGES,
        baseline=True,
        onednn_settings=True,
        untimed={"torch-export": "pt2e int8 graphs run reference kernels in eager mode: timed compiled only"},
    ),
    TORCH_COMPILE: Backend(_TORCH_FILES, "pipeline.runtimes.torch_backend:open_compiled", _TORCH_PACKAGES),
}

__all__ = [
    "ONNXRUNTIME",
    "RUNTIME_BACKENDS",
    "TORCH_COMPILE",
    "TORCH_EAGER",
    "Backend",
    "ModelManifest",
    "Runtime",
    "Variant",
    "baseline_backend",
    "image_backend",
    "open_file",
    "open_runtime",
    "read_manifest",
    "runtimes_for",
]


def runtimes_for(fmt: str, first: str | None = None) -> list[str]:
    """The backends that open files of format `fmt`, in the table's order (`first` moved to the front)."""
    names = [name for name, backend in RUNTIME_BACKENDS.items() if fmt in backend.formats]
    return sorted(names, key=lambda name: name != first)


def image_backend() -> str:
    """The backend the server image runs: the table's first with `image` (evaluate measures the shipped variant on
    it; the model card names it for a variant the benchmark did not choose)."""
    return next(name for name, backend in RUNTIME_BACKENDS.items() if backend.image)


def baseline_backend() -> str:
    """PyTorch's default eager, the benchmark's baseline: the table's backend with `baseline`."""
    return next(name for name, backend in RUNTIME_BACKENDS.items() if backend.baseline)


def _opener(backend: str) -> Opener:
    return pkgutil.resolve_name(RUNTIME_BACKENDS[backend].opener)


def open_file(
    path: Path,
    variant: Variant,
    image_size: int,
    backend: str = "auto",
    threads: int | None = None,
    spin: bool = True,
) -> Runtime:
    """A runtime for one variant file (the optimize stage uses it before the manifest exists)."""
    if backend == "auto":
        backend = variant.runtimes[0]
    if backend not in RUNTIME_BACKENDS:
        raise StageError(f"unknown backend {backend!r}; choose one of auto, {', '.join(RUNTIME_BACKENDS)}")
    if backend not in variant.runtimes:
        raise StageError(
            f"variant {variant.name!r} ({variant.format}) cannot run on {backend}; "
            f"it runs on {', '.join(variant.runtimes)}"
        )
    if not Path(path).exists():
        raise StageError(f"{path} not found (variant {variant.name!r})")
    if variant.sha256 and sha256_of(Path(path)) != variant.sha256:
        # Checked before any loader parses the file: a swapped or corrupted file is never opened.
        raise StageError(
            f"{path} does not match the SHA-256 its manifest records for {variant.name!r}: the file was changed "
            "or corrupted after the optimize stage made it; rerun `pipeline optimize` (or `dvc pull`)"
        )
    try:
        return _opener(backend)(Path(path), variant.format, variant.name, image_size, threads, spin)
    except ValueError as exc:
        raise StageError(str(exc)) from None


def open_runtime(
    models_dir: Path, variant: str, backend: str = "auto", threads: int | None = None, spin: bool = True
) -> Runtime:
    """Open shipped variant `variant` of `models_dir` on `backend` (`auto`: the variant's first runtime).
    Unknown or rejected variants and backends that cannot run the variant raise a StageError."""
    manifest = read_manifest(models_dir)
    info = manifest.variant(variant)
    return open_file(Path(models_dir) / info.file, info, manifest.image_size, backend, threads, spin)
