"""Loading the `.pt2` variants (format torch-export: the int8 pt2e graph) without running code from the file.

Its graph is JSON naming registered operators. Its tensors are either raw bytes described by JSON, or pickles:
torch's archive reader unpickles an entry marked `use_pickle` (and custom or opaque objects) with full pickle,
and falls back to full unpickling when a weights-only load fails. So before torch sees the file, `check_archive`
refuses any archive holding a pickled entry, a custom/opaque object or compiled (AOTInductor) code, and the
loader's remaining pickle reads go through weights_only=True with no fallback. The `.pt` format
(torch-state-dict) is the trained model's: pipeline/artifacts/model.py.

Imports torch: only the torch runtimes and the optimize stage import this module.
"""

from __future__ import annotations

import io
import json
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.errors import StageError


@contextmanager
def _tensors_weights_only() -> Any:
    """Inside: torch.export.load reads tensors with weights_only=True and never falls back."""
    from torch._export.serde import serialize

    original = serialize.deserialize_torch_artifact

    def strict(serialized: Any) -> Any:
        if isinstance(serialized, dict | tuple) or len(serialized) == 0:
            return original(serialized)
        artifact = torch.load(io.BytesIO(serialized), weights_only=True)
        if not isinstance(artifact, dict | tuple):
            raise ValueError(f"expected a dict or tuple of tensors, got {type(artifact).__name__}")
        return artifact

    serialize.deserialize_torch_artifact = strict
    try:
        yield
    finally:
        serialize.deserialize_torch_artifact = original


_CODE_PREFIXES = ("custom_obj_", "opaque_obj_")  # torch's CUSTOM_OBJ / OPAQUE_OBJ file name prefixes


def _pickled_entries(config: Any) -> list[str]:
    """Names of the payload entries of an archive's weights/constants config that torch would unpickle."""
    entries = config.get("config", {}) if isinstance(config, dict) else {}
    if not isinstance(entries, dict):
        return ["<malformed config>"]
    return [
        str(name)
        for name, meta in entries.items()
        if not isinstance(meta, dict)
        or meta.get("use_pickle") is not False
        or str(meta.get("path_name", "")).startswith(_CODE_PREFIXES)
    ]


def check_archive(path: Path) -> None:
    """Refuse a .pt2 archive whose loading could run code (see the module docstring); a StageError says why."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            for name in names:
                if "aotinductor" in name or name.endswith((".so", ".dll", ".dylib")):
                    raise StageError(f"{path}: holds compiled code ({name}); refusing to load it")
                if name.endswith("_config.json") and "/data/" in name:
                    pickled = _pickled_entries(json.loads(archive.read(name)))
                    if pickled:
                        raise StageError(
                            f"{path}: {name} marks {len(pickled)} entries (first: {pickled[0]}) as pickled objects, "
                            "which loading would unpickle and could run code; refusing to load it"
                        )
    except (zipfile.BadZipFile, OSError, ValueError, UnicodeDecodeError) as exc:
        raise StageError(f"{path}: not a readable torch.export archive ({exc})") from None


def load_exported(path: Path) -> nn.Module:
    """The module of a torch.export archive (the int8 pt2e variant), checked by `check_archive` first."""
    import torchao.quantization.pt2e  # noqa: F401  (registers the quantize/dequantize operators)

    if not Path(path).is_file():
        raise StageError(f"{path} not found")
    check_archive(Path(path))
    try:
        with _tensors_weights_only():
            program = torch.export.load(str(path))
    except FileNotFoundError:
        raise StageError(f"{path} not found") from None
    except Exception as exc:
        raise StageError(f"{path}: not a loadable torch.export archive ({type(exc).__name__}: {exc})") from None
    return program.module()
