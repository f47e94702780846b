"""pipeline.runtimes: the manifest, open_runtime's errors, and the backends (no torch for ONNX)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.artifacts.checksum import sha256_of
from pipeline.artifacts.variants import InputSpec, ModelManifest, Preprocess, Variant, write_manifest
from pipeline.errors import StageError
from pipeline.runtimes import open_runtime, read_manifest
from tests.helpers import REPO

SIZE = 4


def _tiny_onnx(path: Path, seed: int = 0) -> np.ndarray:
    """images [N, 3, 4, 4] -> Flatten -> MatMul -> logits [N, 43], built with onnx.helper (no torch)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(seed).standard_normal((3 * SIZE * SIZE, 43)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Flatten", ["images"], ["flat"]), helper.make_node("MatMul", ["flat", "w"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 43])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return weight


def _variant(name: str, file: str, fmt: str, runtimes: list[str], accepted: bool = True) -> Variant:
    return Variant(
        name=name,
        file=file if accepted else "",
        format=fmt,  # type: ignore[arg-type]
        runtimes=runtimes,
        precision="fp32",
        accuracy=0.9,
        accuracy_drop=0.0 if accepted else 0.1,
        size_bytes=1,
        sha256="0" * 64,
        parameters=1,
        accepted=accepted,
        reason="" if accepted else "accuracy drop 10.00 points > 0.50 allowed",
    )


def _write(models: Path, variants: list[Variant]) -> ModelManifest:
    """The manifest, each existing variant file's real SHA-256 recorded (runtimes check it before opening)."""
    variants = [
        v.model_copy(update={"sha256": sha256_of(models / v.file)}) if v.file and (models / v.file).is_file() else v
        for v in variants
    ]
    manifest = ModelManifest(
        architecture="tiny",
        classes=[str(i) for i in range(43)],
        num_classes=43,
        image_size=SIZE,
        preprocess=Preprocess(roi_margin=0.1, resize=SIZE, mean=[0.5] * 3, std=[0.25] * 3),
        input=InputSpec(name="images", shape=[-1, 3, SIZE, SIZE]),
        output=InputSpec(name="logits", shape=[-1, 43]),
        baseline_accuracy=0.9,
        test_images=10,
        max_accuracy_drop=0.005,
        variants=variants,
    )
    write_manifest(models, manifest)
    return manifest


@pytest.fixture
def models(tmp_path: Path) -> Path:
    folder = tmp_path / "models"
    (folder / "variants").mkdir(parents=True)
    _tiny_onnx(folder / "variants" / "fp32-onnx.onnx")
    _write(
        folder,
        [
            _variant("fp32-onnx", "variants/fp32-onnx.onnx", "onnx", ["onnxruntime"]),
            _variant("pruned-onnx", "variants/pruned-onnx.onnx", "onnx", ["onnxruntime"], accepted=False),
        ],
    )
    return folder


def test_a_file_that_does_not_match_its_manifest_is_never_opened(models: Path) -> None:
    (models / "variants" / "fp32-onnx.onnx").write_bytes(b"swapped")
    with pytest.raises(StageError, match=r"does not match the SHA-256 its manifest records for 'fp32-onnx'"):
        open_runtime(models, "fp32-onnx")


def test_manifest_round_trip(models: Path) -> None:
    manifest = read_manifest(models)
    assert [v.name for v in manifest.accepted()] == ["fp32-onnx"]
    raw = json.loads((models / "manifest.json").read_text())
    assert raw["preprocess"]["layout"] == "NCHW" and raw["preprocess"]["input_range"] == [0.0, 1.0]
    assert raw["input"] == {"name": "images", "shape": [-1, 3, SIZE, SIZE], "dtype": "float32"}
    for key in ("name", "file", "format", "runtimes", "accuracy", "accuracy_drop", "size_bytes", "sha256"):
        assert key in raw["variants"][0]


def test_onnx_runtime_predicts(models: Path) -> None:
    weight = np.random.default_rng(0).standard_normal((3 * SIZE * SIZE, 43)).astype(np.float32)
    runtime = open_runtime(models, "fp32-onnx", threads=1)
    assert runtime.name == "onnxruntime" and runtime.variant == "fp32-onnx"
    x = np.random.default_rng(1).random((5, 3, SIZE, SIZE), dtype=np.float32)
    np.testing.assert_allclose(runtime.predict(x), x.reshape(5, -1) @ weight, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"shape \[N, 3, 4, 4\]"):
        runtime.predict(np.zeros((2, 3, 8, 8), np.float32))
    with pytest.raises(ValueError, match="float32"):
        runtime.predict(np.zeros((2, 3, SIZE, SIZE), np.float64))


def test_unknown_variant_backend_and_rejected(models: Path, tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"unknown variant 'nope'; shipped variants: fp32-onnx"):
        open_runtime(models, "nope")
    with pytest.raises(StageError, match=r"unknown backend 'tensorrt'"):
        open_runtime(models, "fp32-onnx", backend="tensorrt")
    with pytest.raises(StageError, match=r"cannot run on torch-eager; it runs on onnxruntime"):
        open_runtime(models, "fp32-onnx", backend="torch-eager")
    with pytest.raises(StageError, match=r"'pruned-onnx' was rejected .*accuracy drop"):
        open_runtime(models, "pruned-onnx")
    with pytest.raises(StageError, match=r"manifest.json not found"):
        open_runtime(tmp_path / "elsewhere", "fp32-onnx")
    (models / "manifest.json").write_text('{"classes": []}')
    with pytest.raises(StageError, match=r"manifest.json: invalid manifest"):
        read_manifest(models)


def test_missing_file_is_named(models: Path) -> None:
    (models / "variants" / "fp32-onnx.onnx").unlink()
    with pytest.raises(StageError, match=r"fp32-onnx.onnx not found"):
        open_runtime(models, "fp32-onnx")


def test_onnx_path_does_not_import_torch(models: Path) -> None:
    """The server image has no torch: reading the manifest and running ONNX must not import it."""
    code = (
        "import sys, numpy as np\n"
        "from pipeline.runtimes import open_runtime\n"
        f"rt = open_runtime({str(models)!r}, 'fp32-onnx')\n"
        f"assert rt.predict(np.zeros((2, 3, {SIZE}, {SIZE}), np.float32)).shape == (2, 43)\n"
        "bad = [m for m in ('torch', 'torchvision', 'torchao', 'mlflow') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_torch_eager_runs_a_state_dict_variant(tmp_path: Path) -> None:
    import torch

    from pipeline.architectures import nets
    from pipeline.artifacts import model as model_file

    torch.manual_seed(0)
    size = 16
    model = nets.build("signnet", [0.5] * 3, [0.25] * 3, size, width=4).eval()
    folder = tmp_path / "models"
    (folder / "variants").mkdir(parents=True)
    like = {"arch": nets.arch_kwargs("signnet", size, 4, 0.2), "mean": [0.5] * 3, "std": [0.25] * 3}
    model_file.write_like(folder / "variants" / "fp32.pt", model, like)
    manifest = _write(folder, [_variant("fp32", "variants/fp32.pt", "torch-state-dict", ["torch-eager"])])
    manifest = manifest.model_copy(update={"image_size": size})
    write_manifest(folder, manifest)
    runtime = open_runtime(folder, "fp32", backend="auto")
    assert runtime.name == "torch-eager"
    x = torch.rand(3, 3, size, size)
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(runtime.predict(x.numpy()), expected, rtol=1e-5, atol=1e-5)


def test_onnx_runtime_threads_follow_omp_num_threads_and_an_explicit_count_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from pipeline.machine import usable_cpus
    from pipeline.runtimes.onnx import OnnxRuntime

    _tiny_onnx(tmp_path / "m.onnx")

    def threads(count: int | None = None) -> int:
        runtime = OnnxRuntime(tmp_path / "m.onnx", "fp32-onnx", SIZE, threads=count)
        return int(runtime.session.get_session_options().intra_op_num_threads)

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads() == (0 if usable_cpus() == os.cpu_count() else usable_cpus())  # 0: ONNX Runtime's own default
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert threads() == 1 and threads(2) == 2
