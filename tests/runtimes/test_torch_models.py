"""Loading a `.pt2` (torch.export) variant never runs code from the file: crafted archives, a marker file as proof."""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from pipeline.errors import StageError
from pipeline.runtimes.torch_models import load_exported


class _Payload:
    """Unpickling this runs `open(marker, "w")`: what a hostile model file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def exported_archive(path: Path) -> Path:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    torch.export.save(torch.export.export(model, (torch.rand(1, 3, 8, 8),)), str(path))
    return path


def rewrite(source: Path, target: Path, change: dict[str, bytes]) -> None:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, change.get(info.filename, src.read(info.filename)))


def weights_config_name(archive: Path) -> str:
    with zipfile.ZipFile(archive) as z:
        return next(n for n in z.namelist() if n.endswith("weights_config.json"))


def crafted_use_pickle(tmp_path: Path, marker: Path) -> Path:
    """A genuine archive whose first weight is re-marked `use_pickle` and replaced by a hostile pickle."""
    clean = exported_archive(tmp_path / "clean.pt2")
    config_name = weights_config_name(clean)
    with zipfile.ZipFile(clean) as z:
        config = json.loads(z.read(config_name))
    first = next(iter(config["config"]))
    config["config"][first]["use_pickle"] = True
    weight_file = config_name.rsplit("/", 1)[0] + "/" + config["config"][first]["path_name"]
    crafted = tmp_path / "crafted.pt2"
    rewrite(clean, crafted, {config_name: json.dumps(config).encode(), weight_file: pickle.dumps(_Payload(marker))})
    return crafted


def test_a_clean_archive_loads(tmp_path: Path) -> None:
    module = load_exported(exported_archive(tmp_path / "clean.pt2"))
    assert module(torch.rand(1, 3, 8, 8)).shape == (1, 4, 6, 6)


def test_torchs_own_loader_runs_the_crafted_archives_code(tmp_path: Path) -> None:
    """The threat is real: torch.export.load executes the payload of the crafted archive below."""
    marker = tmp_path / "ran-torch"
    crafted = crafted_use_pickle(tmp_path, marker)
    with pytest.raises(Exception):  # noqa: B017  (the payload returns a file object, not a tensor: torch fails after)
        torch.export.load(str(crafted))
    assert marker.exists()


def test_a_use_pickle_archive_is_refused_without_running_code(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    crafted = crafted_use_pickle(tmp_path, marker)
    with pytest.raises(StageError, match="pickled objects"):
        load_exported(crafted)
    assert not marker.exists()


def test_custom_objects_compiled_code_and_garbage_are_refused(tmp_path: Path) -> None:
    clean = exported_archive(tmp_path / "clean.pt2")
    config_name = weights_config_name(clean)
    with zipfile.ZipFile(clean) as z:
        config = json.loads(z.read(config_name))
    first = next(iter(config["config"]))
    config["config"][first]["path_name"] = "custom_obj_0"
    custom = tmp_path / "custom.pt2"
    rewrite(clean, custom, {config_name: json.dumps(config).encode()})
    with pytest.raises(StageError, match="pickled objects"):
        load_exported(custom)

    compiled = tmp_path / "aoti.pt2"
    rewrite(clean, compiled, {})
    with zipfile.ZipFile(compiled, "a") as z:
        z.writestr("clean/data/aotinductor/model/model.so", b"\x7fELF")
    with pytest.raises(StageError, match="compiled code"):
        load_exported(compiled)

    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"not a zip archive")
    with pytest.raises(StageError, match="not a readable"):
        load_exported(garbage)
    with pytest.raises(StageError, match="not found"):
        load_exported(tmp_path / "missing.pt2")
