"""A network is one file: registered in pipeline/architectures/ (one line in the table), or a file of your project
named in params.yaml (`model.name: path/to/file.py:function`), each then trained, exported and served by the stages."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import architectures
from pipeline.architectures import nets
from pipeline.config import ConfigError, parse_params

TOY = '''
from torch import nn

from pipeline.architectures import NetSpec
from pipeline.architectures.nets import Normalize


def build(spec: NetSpec) -> nn.Module:
    """Two convolutions and a linear layer: the smallest network the stages accept."""
    return nn.Sequential(
        Normalize(spec.mean, spec.std),
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, spec.num_classes),
    )
'''


def test_a_registered_network_is_one_file_and_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toynet_module.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="unknown network 'toynet'"):
        parse_params({"model": {"name": "toynet"}})
    monkeypatch.setitem(architectures.ARCHITECTURES, "toynet", "toynet_module")  # the one line
    assert parse_params({"model": {"name": "toynet", "members": 2}}).model.name == "toynet"
    model = nets.build("toynet", [0.5] * 3, [0.25] * 3, 16, num_classes=5, members=2)
    assert isinstance(model, nets.Committee) and model.eval()(np_images(2)).shape == (2, 5)


def np_images(n: int):  # type: ignore[no-untyped-def]
    import torch

    return torch.rand(n, 3, 16, 16)


def test_a_network_of_your_project_trains_exports_and_serves(tiny_project: Path, tmp_path: Path) -> None:
    """The toy network in the project's own `nets/toy.py`: train, optimize (ONNX, int8) and the served runtime."""
    from pipeline.runtimes import open_runtime
    from pipeline.stages import optimize, train
    from tests.helpers.project import with_network

    work = tmp_path / "project"
    raw = with_network(tiny_project, work, TOY)
    (work / "params.yaml").write_text(yaml.safe_dump(raw))
    params = parse_params(raw)
    with contextlib.chdir(work):
        train.run(params)
        optimize.run(params)
        manifest = yaml.safe_load(Path("models/manifest.json").read_text())
        assert manifest["architecture"] == "nets/toy.py:build"
        accepted = [v["name"] for v in manifest["variants"] if v["accepted"]]
        assert {"fp32-onnx", "int8-onnx"} & set(accepted), manifest["variants"]
        runtime = open_runtime(
            Path("models"), accepted[-1] if "onnx" in accepted[-1] else "fp32-onnx", backend="onnxruntime"
        )
        size = manifest["input"]["shape"][-1]
        logits = runtime.predict(np.zeros((3, 3, size, size), dtype=np.float32))
        assert logits.shape == (3, len(manifest["classes"]))
    with pytest.raises(ValueError, match=r"nope\.py is not a file"), contextlib.chdir(tmp_path):
        nets.build("nope.py:build", [0.5] * 3, [0.25] * 3, 16)
