"""Training checkpoints: torch.distributed.checkpoint (DCP) folders, written atomically and verified, and the
folders they live in.

Layout: `<train.checkpoint_dir>/<fingerprint>/step_00000123/` (one folder per params + data fingerprint, so changing
a param starts a new folder and changing it back resumes the old one) holds DCP's files (`.metadata`,
`__0_0.distcp`, ...), the trainer's state (`trainer.json`: step, loader position, history, the time budget and early
stopping; pipeline/training/state.py), with early stopping the best epoch's weights (`best.safetensors`), and,
written last, `COMPLETE.json` with the size and SHA-256 of every other file. A folder is written as
`step_....partial` and renamed only once complete, so a run killed while saving leaves a `.partial` folder that is
ignored (and removed by the next save). A complete folder whose files no longer match `COMPLETE.json` is corrupt:
resuming stops with its name instead of using it. The newest `train.keep_checkpoints` step folders of a run are kept,
and the KEEP_OTHER_RUNS newest folders of other fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline import console
from pipeline.artifacts._files import fsync_dir
from pipeline.artifacts.checksum import sha256_of
from pipeline.errors import StageError

if TYPE_CHECKING:
    from pipeline.artifacts.prepared import PreparedManifest
    from pipeline.config import Params

MARKER = "COMPLETE.json"
TRAINER_STATE = "trainer.json"
BEST_WEIGHTS = "best.safetensors"  # early stopping's best epoch so far (whole, from rank 0)
PARTIAL_SUFFIX = ".partial"
_NAME = re.compile(r"^step_(\d{8})$")
KEEP_OTHER_RUNS = 2  # checkpoint folders of other params/data kept beside the current run's (newest first)

# Params that do not change the training trajectory: a checkpoint made with other values still resumes.
_NOT_TRAJECTORY = {
    "checkpoint_dir",
    "nproc",
    "strategy",
    "device",
    "compile",
    "threads",
    "checkpoint_every",
    "keep_checkpoints",
    "eval_batch_size",
}


def fingerprint(params: Params, manifest: PreparedManifest) -> str:
    """What a checkpoint must match to be resumed: model, recipe and data (its content hash included)."""
    train = {k: v for k, v in params.train.model_dump().items() if k not in _NOT_TRAJECTORY}
    blob = json.dumps(
        {
            "model": params.model.model_dump(),
            "train": train,
            "augment": params.augment.model_dump(),
            "regularize": params.regularize.model_dump(),
            "image_size": manifest.image_size,
            "mean": manifest.mean,
            "std": manifest.std,
            "data": manifest.content_sha256,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_folder(params: Params, manifest: PreparedManifest) -> Path:
    """This run's checkpoint folder: one per fingerprint, so changing a param (or the data) starts a new folder
    and switching back resumes the old one; nothing is deleted on the way."""
    return Path(params.train.checkpoint_dir) / fingerprint(params, manifest)


def retire_other_runs(current: Path, main: bool) -> None:
    """Keep the KEEP_OTHER_RUNS most recent other runs' folders; remove older ones (and step folders of the
    layout before fingerprint folders), saying so."""
    root = current.parent
    if not main or not root.is_dir():
        return
    others = [p for p in root.iterdir() if p.is_dir() and p != current]
    legacy = [p for p in others if p.name.startswith("step_")]
    runs = sorted((p for p in others if p not in legacy), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in legacy + runs[KEEP_OTHER_RUNS:]:
        console.log(f"removing old checkpoints of other params or data: {old}")
        shutil.rmtree(old, ignore_errors=True)


def find_resume(params: Params, manifest: PreparedManifest, main: bool) -> Resume | None:
    """The run's newest complete checkpoint, verified (None: start from scratch); the main process first removes
    the folders of a save that was interrupted, saying so."""
    folder = run_folder(params, manifest)
    if main:
        for partial in partial_folders(folder):
            console.log(f"removing incomplete checkpoint {partial} (interrupted while saving)")
            shutil.rmtree(partial, ignore_errors=True)
    resume = latest(folder)
    if resume is None:
        return None
    if resume.state.get("fingerprint") != fingerprint(params, manifest):  # a folder copied or renamed by hand
        raise StageError(f"{resume.folder} was made with other params or data than its folder name says; delete it")
    return resume


def folder_name(step: int) -> str:
    return f"step_{step:08d}"


def seal(partial: Path, trainer_state: dict[str, Any]) -> Path:
    """Write the trainer state and the marker into a fully written `.partial` folder, then rename it.
    Called by one process after every process has finished writing its DCP shards."""
    (partial / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=1))
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(partial.rglob("*")):
        if path.is_file() and path.name != MARKER:
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
            files[str(path.relative_to(partial))] = {"size": path.stat().st_size, "sha256": sha256_of(path)}
    marker = partial / MARKER
    marker.write_text(json.dumps({"files": files}, indent=1))
    with marker.open("rb") as fh:
        os.fsync(fh.fileno())
    final = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    fsync_dir(final.parent)
    return final


def complete_folders(root: Path) -> list[Path]:
    """Complete-looking checkpoint folders (named step_NNNNNNNN), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: p.name)


def partial_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.endswith(PARTIAL_SUFFIX))


class _FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    size: int
    sha256: str


class _Marker(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    files: dict[str, _FileEntry]


def verify(folder: Path) -> dict[str, Any]:
    """Check every file against the marker; return the trainer state. StageError names what is wrong."""
    marker = folder / MARKER
    hint = f"delete {folder} to resume from an older checkpoint, or models/checkpoints to start over"
    if not marker.exists():
        raise StageError(f"checkpoint {folder} is incomplete: {MARKER} is missing ({hint})")
    try:
        files = _Marker.model_validate_json(marker.read_bytes()).files
    except (ValidationError, OSError):
        raise StageError(f"checkpoint {folder} is corrupt: {MARKER} is not a checkpoint marker ({hint})") from None
    for name, info in files.items():
        path = folder / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise StageError(f"checkpoint {folder} is corrupt: {MARKER} names a file outside it ({name}) ({hint})")
        if not path.is_file():
            raise StageError(f"checkpoint {folder} is corrupt: {name} is missing ({hint})")
        size = path.stat().st_size
        if size != info.size:
            raise StageError(
                f"checkpoint {folder} is corrupt: {name} has {size} bytes, expected {info.size} (truncated?) ({hint})"
            )
        if sha256_of(path) != info.sha256:
            raise StageError(f"checkpoint {folder} is corrupt: {name} fails its SHA-256 check ({hint})")
    if TRAINER_STATE not in files:
        raise StageError(f"checkpoint {folder} is corrupt: {TRAINER_STATE} is missing ({hint})")
    try:
        state: dict[str, Any] = json.loads((folder / TRAINER_STATE).read_text())
    except ValueError:
        raise StageError(f"checkpoint {folder} is corrupt: {TRAINER_STATE} is not JSON ({hint})") from None
    if not isinstance(state, dict):
        raise StageError(f"checkpoint {folder} is corrupt: {TRAINER_STATE} is not a JSON object ({hint})")
    return state


@dataclass(frozen=True)
class Resume:
    folder: Path
    state: dict[str, Any]


def latest(root: Path) -> Resume | None:
    """The newest complete checkpoint, verified; None when there is none. Never falls back silently:
    a corrupt newest checkpoint raises StageError naming it."""
    folders = complete_folders(root)
    if not folders:
        return None
    folder = folders[-1]
    return Resume(folder, verify(folder))


def prune(root: Path, keep: int) -> None:
    """Remove leftover `.partial` folders and all but the `keep` newest complete checkpoints."""
    for path in partial_folders(root):
        shutil.rmtree(path, ignore_errors=True)
    for path in complete_folders(root)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------ DCP: the model and optimizer state


def save(
    root: Path,
    step: int,
    model: Any,
    optim: Any,
    trainer_state: dict[str, Any],
    d: Any,
    keep: int,
    best: Mapping[str, Any] | None = None,
) -> Path:
    """Every process writes its shard of model + optimizer state into `root/step_N.partial`; then rank 0
    seals it (`best`: early stopping's best weights, rank 0's; trainer state, marker) and prunes old folders.
    `d` is the caller's training.distributed.Dist."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    partial = root / (folder_name(step) + PARTIAL_SUFFIX)
    if d.main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    d.barrier()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(partial))
    d.barrier()
    final = root / folder_name(step)
    if d.main:
        if best is not None:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in best.items()}, str(partial / BEST_WEIGHTS))
        seal(partial, trainer_state)
        prune(root, keep)
    d.barrier()
    return final


def load(folder: Path, model: Any, optim: Any) -> None:
    """Load a verified folder's model + optimizer state in place (resharded to this run's processes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    try:
        # loads in place; the reader never unpickles anything but DCP's own metadata classes
        dcp.load({"model": model_sd, "optim": optim_sd}, storage_reader=_safe_reader(folder))
    except (Exception, CheckpointException) as exc:  # CheckpointException derives from BaseException
        cause: BaseException = exc
        if isinstance(exc, CheckpointException) and exc.failures:
            cause = next(iter(exc.failures.values()))[0]  # the rank's own error, not DCP's wrapper
        first = (str(cause).strip().splitlines() or [""])[0][:300]
        raise StageError(f"checkpoint {folder} cannot be loaded ({type(cause).__name__}: {first})") from None
    set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)


def best_weights(folder: Path) -> dict[str, Any]:
    """Early stopping's best weights saved in a verified folder (tensors only: nothing is unpickled)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / BEST_WEIGHTS
    if not path.is_file():
        raise StageError(
            f"checkpoint {folder} is corrupt: {TRAINER_STATE} names a best epoch but {BEST_WEIGHTS} is missing "
            f"(delete {folder} to resume from an older checkpoint)"
        )
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise StageError(f"checkpoint {folder}: {BEST_WEIGHTS} cannot be loaded ({exc})") from None


# What DCP's `.metadata` pickle may hold: its own dataclasses, torch's dtype/size/layout/memory-format
# values and plain containers. Anything else (a crafted, re-sealed checkpoint) is refused, not executed:
# the marker's checksums prove a folder is whole, not that whoever sealed it is trusted.
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "dtype"),
    ("torch", "layout"),
    ("torch", "memory_format"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch.serialization", "_get_layout"),  # layout by name; torch's weights_only loader allows it too
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


def _safe_reader(folder: Path) -> Any:
    import pickle

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
            ):
                return getattr(torch, name)
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with (folder / ".metadata").open("rb") as fh:
                metadata = Unpickler(fh).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"checkpoint metadata is a {type(metadata).__name__}, not DCP Metadata")
            storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    return Reader(str(folder))


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole model's weights on CPU (gathered from every process when sharded)."""
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
