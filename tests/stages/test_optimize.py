"""The optimize stage: pruning surgery, export parity, int8 gates, shipping and the MLflow registry."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from pipeline.architectures import nets
from pipeline.architectures.signnet import SignNet
from pipeline.artifacts import model as model_file
from pipeline.artifacts.prepared import read_split
from pipeline.config import Params, parse_params
from pipeline.errors import StageError
from pipeline.optimize import export, prune, quantize
from tests.helpers import model as model_helper
from tests.helpers import prepared as prepared_helper
from tests.helpers.params import SYNTHETIC_NAME, TEST_RECIPE

MEAN, STD = [0.3, 0.3, 0.3], [0.25, 0.25, 0.25]


def write_prepared(root: Path, size: int = 16) -> Path:
    """430 train, 129 val and 129 test images of class-coloured squares."""
    return prepared_helper.write_prepared(
        root, (430, 129, 129), size, pixels="coloured_squares", mean=(0.3, 0.3, 0.3), std=(0.25, 0.25, 0.25)
    )


def write_model(root: Path, steps: int = 80, members: int = 1) -> Path:
    return model_helper.write_model(root, steps=steps, members=members)


def _randomize_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean = torch.randn(n, generator=g) * 0.1
            m.running_var = torch.rand(n, generator=g) + 0.5
            m.weight.data = torch.rand(n, generator=g) + 0.5
            m.bias.data = torch.randn(n, generator=g) * 0.1
    return model.eval()


@torch.no_grad()
def _masked(model: nn.Module, amount: float, norm: str) -> nn.Module:
    """The same pruning done by masking: a filter whose BN scale and shift are 0 outputs relu(0) = 0."""
    layers = [m for m in model.modules() if isinstance(m, nn.Conv2d | nn.BatchNorm2d)]
    for conv, bn in zip(layers[::2], layers[1::2], strict=True):
        assert isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)
        n_keep = max(1, conv.out_channels - round(amount * conv.out_channels))
        keep = torch.topk(prune.filter_norms(conv, norm, bn), n_keep).indices  # type: ignore[arg-type]
        drop = torch.ones(conv.out_channels, dtype=torch.bool)
        drop[keep] = False
        bn.weight[drop] = 0.0
        bn.bias[drop] = 0.0
    return model


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_pruning_removes_channels_and_equals_masking(norm: str, tmp_path: Path) -> None:
    import copy

    torch.manual_seed(0)
    model = _randomize_bn(nets.build("signnet", MEAN, STD, 32, width=8))
    masked = _masked(copy.deepcopy(model), 0.5, norm)
    pruned = copy.deepcopy(model)
    report = prune.prune_filters(pruned, 0.5, norm)  # type: ignore[arg-type]
    assert report.channels_before == [8, 8, 16, 16, 32, 32]
    assert report.channels_after == [4, 4, 8, 8, 16, 16]
    x = torch.rand(5, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(pruned(x), masked(x), atol=1e-5, rtol=1e-4)
    assert nets.count_parameters(pruned) < 0.3 * nets.count_parameters(model)

    like = {"arch": nets.arch_kwargs("signnet", 32, 8, 0.2), "mean": MEAN, "std": STD, "classes": []}
    model_file.write_like(tmp_path / "full.pt", model, like)
    model_file.write_like(tmp_path / "pruned.pt", pruned, like)
    assert (tmp_path / "pruned.pt").stat().st_size < 0.5 * (tmp_path / "full.pt").stat().st_size
    reloaded, _ = model_file.read(tmp_path / "pruned.pt")  # layers resized to the saved shapes
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), pruned(x))


def test_pruning_flatten_classifier() -> None:
    """trafficsignnet: the last conv feeds a Linear through Flatten (C x 6 x 6 columns per channel)."""
    torch.manual_seed(0)
    model = nets.build("trafficsignnet", MEAN, STD, 32).eval()
    x = torch.rand(3, 3, 32, 32)
    report = prune.prune_filters(model, 0.25, "l2")
    assert report.channels_after == [24, 48]
    linear = model.classifier[1]
    assert isinstance(linear, nn.Linear) and linear.in_features == 48 * 36
    assert model(x).shape == (3, 43)


@pytest.mark.parametrize("exporter", ["tracing", pytest.param("dynamo", marks=pytest.mark.slow)])  # dynamo: slow
def test_export_parity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exporter: str) -> None:
    """The tracing exporter, and the dynamo exporter where tracing fails (or a torch has no tracer): either file has
    a dynamic batch, holds its weights, and matches torch on several batch sizes."""
    import onnx

    from pipeline.runtimes.onnx import OnnxRuntime

    used: list[str] = []
    real_export = torch.onnx.export

    def export_as_this_torch_would(*args: object, **kwargs: object) -> object:
        used.append("dynamo" if kwargs.get("dynamo") else "tracing")
        if exporter == "dynamo" and not kwargs.get("dynamo"):
            raise RuntimeError("this torch cannot trace the network")
        return real_export(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.onnx, "export", export_as_this_torch_would)
    torch.manual_seed(0)
    model = _randomize_bn(nets.build("signnet", MEAN, STD, 16, width=4))
    path = export.export_onnx(model, tmp_path / "m.onnx", 16)
    assert used == (["tracing"] if exporter == "tracing" else ["tracing", "dynamo"])
    graph = onnx.load(str(path)).graph
    dim0 = graph.input[0].type.tensor_type.shape.dim[0]
    assert graph.input[0].name == export.INPUT_NAME and dim0.dim_param and not dim0.dim_value
    assert not list(tmp_path.glob("*.data")), "weights must be inside the .onnx file"
    runtime = OnnxRuntime(path, "fp32-onnx", 16)
    for n in (1, 7, 64):
        x = torch.rand(n, 3, 16, 16)
        with torch.no_grad():
            ref = model(x).numpy()
        result = export.parity(ref, runtime.predict(x.numpy()), 1e-4, 1.0)
        assert result.passed, result


def test_parity_gate_catches_a_different_model() -> None:
    ref = np.eye(4, dtype=np.float32)
    assert export.parity(ref, ref + 1e-6, 1e-4, 1.0).passed
    flipped = ref[:, ::-1].copy()
    result = export.parity(ref, flipped, 10.0, 0.99)
    assert not result.passed and result.top1_agreement == 0.0


def test_parity_bound_scales_with_the_logits() -> None:
    """Large logits (an efficientnet_b0 after one epoch reaches 334) carry fp32 rounding above the absolute
    bound: the relative bound lets those through, per image, and still catches the same error on small logits."""
    ref = np.array([[300.0, -20.0, 5.0], [2.0, 1.0, 0.5]])
    rounded = ref + np.array([[4e-3, 0, 0], [0, 0, 0]])  # 1.3e-5 of 300: as ONNX Runtime against oneDNN
    assert not export.parity(ref, rounded, 1e-3, 0.999).passed  # the absolute bound alone
    result = export.parity(ref, rounded, 1e-3, 0.999, 1e-4)
    assert result.passed and result.max_abs_diff == pytest.approx(4e-3)
    assert result.max_rel_diff == pytest.approx(4e-3 / 300)
    wrong_small = ref + np.array([[0, 0, 0], [4e-3, 0, 0]])  # the same error on an image whose logits are ~2
    assert not export.parity(ref, wrong_small, 1e-3, 0.999, 1e-4).passed


def test_cpu_feature_checks() -> None:
    assert quantize.has_native_bf16({"bf16"}, "aarch64")
    assert not quantize.has_native_bf16({"avx2"}, "x86_64")
    assert quantize.has_native_bf16({"amx_bf16"}, "x86_64")
    assert quantize.needs_reduce_range("x86_64", {"avx2", "fma"})
    assert not quantize.needs_reduce_range("x86_64", {"avx512_vnni"})
    assert not quantize.needs_reduce_range("aarch64", set())


@pytest.mark.slow  # importing torchao's quantizers alone takes 15-60 s on 2 shared cores
def test_quantizer_by_platform() -> None:
    """x86 gets X86InductorQuantizer (reduce_range without VNNI), aarch64 the Arm quantizer."""
    _, x86 = quantize.make_quantizer("x86_64", flags={"avx2"})
    assert x86 == {"quantizer": "X86InductorQuantizer", "reduce_range": True}
    _, vnni = quantize.make_quantizer("x86_64", flags={"avx512_vnni"})
    assert vnni["reduce_range"] is False
    _, arm = quantize.make_quantizer("aarch64")
    assert arm["quantizer"] == "ArmInductorQuantizer"
    with pytest.raises(ValueError, match="riscv64"):
        quantize.make_quantizer("riscv64")


# ------------------------------------------------------------------------------------------ bad inputs


def _params(tmp: Path | None = None, tracking: bool = False, **optimize: object) -> Params:
    raw = {
        "recipe": str(TEST_RECIPE),
        "name": SYNTHETIC_NAME,
        "data": {"image_size": 16},
        "train": {"batch_size": 32},
        "optimize": {
            "prune_amount": 0.25,
            "prune_multiple": 1,  # tiny networks: 4-8 channels
            "finetune_epochs": 1,
            "finetune_batch_size": 32,
            "calibration_images": 64,
            "max_accuracy_drop": 0.02,
            "student_width": 4,
            "student_epochs": 2,
            **optimize,
        },
        "tracking": {"enabled": tracking, "uri": "sqlite:///mlflow.db", "experiment": "test"},
    }
    return parse_params(raw)


def test_missing_model_names_the_file(workdir: Path) -> None:
    from pipeline.stages.optimize import run

    write_prepared(workdir)
    with pytest.raises(StageError, match=r"models/model.pt not found"):
        run(_params())


def test_mismatched_model_names_the_file(workdir: Path) -> None:
    from pipeline.stages.optimize import run

    write_prepared(workdir, size=16)
    path = write_model(workdir, steps=0)
    payload = torch.load(path, weights_only=True)
    payload["arch"]["num_classes"] = 10
    torch.save(payload, path)
    with pytest.raises(StageError, match=r"models/model.pt: the model has 10 classes, the prepared data 43"):
        run(_params())
    payload["arch"]["num_classes"] = 43
    del payload["state_dict"]["features.0.weight"]
    torch.save(payload, path)
    with pytest.raises(StageError, match=r"models/model.pt: the weights do not match"):
        run(_params())
    write_model(workdir, steps=0)
    write_prepared(workdir, size=24)  # data re-prepared at another size
    with pytest.raises(StageError, match=r"models/model.pt: the model was trained at 16x16"):
        run(_params())
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(StageError, match=r"models/model.pt is not a model saved by"):
        run(_params())


def test_calibration_data_of_the_wrong_shape_names_the_file(workdir: Path) -> None:
    from pipeline.stages.optimize import run

    prepared = write_prepared(workdir)
    write_model(workdir, steps=0)
    np.save(prepared / "train" / "images-00000.npy", np.zeros((10, 16, 16), np.uint8))
    with pytest.raises(StageError, match=r"data/prepared/train/images-00000.npy: images are uint8 \[10, 16, 16\]"):
        run(_params())


# -------------------------------------------------------------------------------- the stage, end to end


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One stage run on tiny data with tracking into a temporary MLflow store (about a minute on 2 cores),
    on a committee of two networks like the default model. prune_amount 0.9 leaves too little of the
    network: the pruned variants must be rejected."""
    import os

    from pipeline.stages.optimize import run

    root = tmp_path_factory.mktemp("optimize")
    write_prepared(root)
    write_model(root, members=2)
    old = Path.cwd()
    os.chdir(root)
    saved = os.environ.pop("MLFLOW_TRACKING_URI", None)
    try:
        run(_params(tracking=True, prune_amount=0.9, finetune_epochs=0, prune_members=1))
    finally:
        os.chdir(old)
        if saved is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved
    return root


@pytest.mark.slow
def test_stage_ships_only_accepted_variants(optimized: Path) -> None:
    manifest = json.loads((optimized / "models" / "manifest.json").read_text())
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert {"fp32", "fp32-onnx", "int8-onnx", "int8-pt2e", "pruned", "pruned-onnx"} <= set(by_name)
    # The distilled student (one network of width 4 against the committee of two): its own rows, fewer MACs.
    assert {"student", "student-onnx", "student-int8-onnx"} <= set(by_name)
    student, teacher = by_name["student"], by_name["fp32"]
    assert student["details"]["student_of"] == "fp32" and student["details"]["student_epochs"] == 2
    assert student["details"]["macs"] < 0.6 * teacher["details"]["macs"]
    assert by_name["student-int8-onnx"]["details"]["macs"] == student["details"]["macs"]
    assert student["parameters"] < teacher["parameters"]
    assert by_name["fp32-onnx"]["accepted"] and by_name["fp32-onnx"]["parity"]["passed"]
    assert by_name["fp32-onnx"]["parity"]["max_abs_diff"] < 1e-3
    for name in ("int8-onnx", "int8-pt2e"):  # made (the committee's graph quantizes), whatever the gate said
        assert not by_name[name]["reason"].startswith("could not be made"), by_name[name]["reason"]
    rejected = [v for v in manifest["variants"] if not v["accepted"]]
    assert {"pruned", "pruned-onnx"} <= {v["name"] for v in rejected}
    shipped = {p.name for p in (optimized / "models" / "variants").iterdir()}
    for v in manifest["variants"]:
        if v["accepted"]:
            path = optimized / "models" / v["file"]
            assert path.name in shipped and path.stat().st_size == v["size_bytes"]
            assert v["accuracy_drop"] <= manifest["max_accuracy_drop"] + 1e-9
        else:
            assert v["file"] == "" and v["reason"]
            assert not any(name.startswith(v["name"] + ".") for name in shipped)
    assert manifest["input"]["shape"] == [-1, 3, 16, 16] and len(manifest["classes"]) == 43
    metrics = json.loads((optimized / "reports" / "optimize" / "metrics.json").read_text())
    assert set(metrics["rejected"]) == {v["name"] for v in rejected}
    assert "| fp32-onnx |" in (optimized / "reports" / "optimize" / "variants.md").read_text()


@pytest.mark.slow
def test_pruning_shrinks_graph_and_file(optimized: Path) -> None:
    manifest = json.loads((optimized / "models" / "manifest.json").read_text())
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert by_name["pruned"]["parameters"] < 0.1 * by_name["fp32"]["parameters"]
    # prune_members 1: the committee's first network alone, pruned
    assert by_name["pruned"]["details"]["prune_members"] == 1
    assert by_name["pruned"]["details"]["macs"] < 0.5 * by_name["fp32"]["details"]["macs"]
    assert by_name["pruned-onnx"]["size_bytes"] < by_name["fp32-onnx"]["size_bytes"]


@pytest.mark.slow
def test_accepted_variants_are_registered(optimized: Path) -> None:
    from mlflow import MlflowClient

    manifest = json.loads((optimized / "models" / "manifest.json").read_text())
    accepted = {v["name"]: v for v in manifest["variants"] if v["accepted"]}
    client = MlflowClient(tracking_uri=f"sqlite:///{optimized / 'mlflow.db'}")
    versions = client.search_model_versions("name = 'signs-classifier'")
    assert sorted(v.tags["variant"] for v in versions) == sorted(accepted)
    for version in versions:
        entry = accepted[version.tags["variant"]]
        assert version.tags["sha256"] == entry["sha256"]
        assert version.tags["size_bytes"] == str(entry["size_bytes"])
        assert float(version.tags["accuracy"]) == pytest.approx(entry["accuracy"], abs=1e-6)


@pytest.mark.slow
def test_registered_versions_are_mlflow_models_that_classify_image_files(
    optimized: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each registered version loads with `mlflow.pyfunc` (a logged model linked to optimize's run) and gives the
    classes the server's own loader and decode give for the same PNG files."""
    import io

    import mlflow
    import pandas as pd
    from mlflow import MlflowClient
    from PIL import Image

    from pipeline.config import ServeConfig
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.serve.model import load_served_model
    from pipeline.serve.protocol import decode_images

    monkeypatch.chdir(optimized)
    uri = f"sqlite:///{optimized / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    pngs = []
    for image in read_split("test", optimized / "data" / "prepared").images[:24]:
        out = io.BytesIO()
        Image.fromarray(image).save(out, format="PNG")
        pngs.append(out.getvalue())
    client = MlflowClient(tracking_uri=uri)
    versions = client.search_model_versions("name = 'signs-classifier'")
    assert versions
    for version in versions:
        variant = version.tags["variant"]
        assert version.source.startswith("models:/m-"), version.source  # an MLflow 3 logged model
        logged = client.get_logged_model(version.source.removeprefix("models:/"))
        assert logged.source_run_id == version.run_id and logged.name == variant
        # The variant travels as an artifact, not as model_config (MLflow logs that as run params, where the
        # run's second variant collided with the first: "Failed to log model config as params").
        assert "variant" not in client.get_run(version.run_id).data.params
        assert "accuracy" in {m.key for m in logged.metrics or []}
        loaded = mlflow.pyfunc.load_model(f"models:/signs-classifier/{version.version}")
        assert loaded.metadata.metadata["preprocess"]["resize"] == 16
        got = loaded.predict(pd.DataFrame({"image": pngs}))
        served = load_served_model(optimized / "models", ServeConfig(variant=variant))
        expected = served.probabilities(decode_images([(b, None) for b in pngs], served.framing, MAX_PIXELS))
        assert list(got["class_id"]) == list(expected.argmax(1)), variant
        assert np.allclose(got["probability"], expected.max(1), atol=1e-5), variant


@pytest.mark.slow
def test_shipped_variants_run_and_agree(optimized: Path) -> None:
    from pipeline.runtimes import open_runtime, read_manifest

    models = optimized / "models"
    x = read_split("test", optimized / "data" / "prepared").images[:16].transpose(0, 3, 1, 2).astype(np.float32) / 255
    reference = open_runtime(models, "fp32").predict(x).argmax(1)
    for v in read_manifest(models).accepted():
        runtime = open_runtime(models, v.name, backend=v.runtimes[-1])
        logits = runtime.predict(x)
        assert logits.shape == (16, 43) and logits.dtype == np.float32
        assert (logits.argmax(1) == reference).mean() >= 0.8, v.name


# ------------------------------------------------------------------------------ the real sample (integration)


@pytest.mark.slow
@pytest.mark.integration
def test_int8_within_gate_on_real_sample(real_sample_optimized: Path) -> None:
    """prepare -> train (a few epochs) -> optimize on the real sample: ONNX Runtime's int8 (what the server ships)
    and torchao's pt2e int8 stay within a point of fp32 on the 645 real test images, and each is shipped exactly
    when it passes the default 0.5-point gate (on one machine pt2e lost 0.62 points and was rejected while on
    others both passed: docs/stages.md, optimize; the shipped model's drop is the gate's business, on its recipe)."""
    manifest = json.loads((real_sample_optimized / "models/manifest.json").read_text())
    by_name = {v["name"]: v for v in manifest["variants"]}
    assert manifest["test_images"] == 645
    fp32 = by_name["fp32"]["served_accuracy"]
    for name in ("int8-onnx", "int8-pt2e"):  # within a point on the report, shipped exactly when within the gate
        variant = by_name[name]
        assert fp32 - variant["served_accuracy"] <= 0.01, variant
        # The gate read no test label: it is the disagreement with fp32 on the files, which bounds the accuracy drop.
        assert variant["accuracy_drop"] >= fp32 - variant["served_accuracy"] - 1e-9, variant
        assert variant["accepted"] == (variant["accuracy_drop"] <= manifest["max_accuracy_drop"] + 1e-9), variant


@pytest.mark.slow
@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_pt2e_int8_round_trip(machine: str, tmp_path: Path) -> None:
    """Both quantizers (x86 here, Arm annotated the same way) give a .pt2 that loads with weights_only
    tensors and stays close to fp32; a file that is not an archive is a StageError naming it."""
    from pipeline.runtimes.torch_models import load_exported

    torch.manual_seed(0)
    model = _randomize_bn(nets.build("signnet", MEAN, STD, 16, width=4))
    calibration = np.random.default_rng(0).random((32, 3, 16, 16), dtype=np.float32)
    info = quantize.quantize_pt2e(model, calibration, tmp_path / "int8.pt2", machine=machine)
    assert info["quantizer"] == ("ArmInductorQuantizer" if machine == "aarch64" else "X86InductorQuantizer")
    loaded = load_exported(tmp_path / "int8.pt2")
    conv_weights = [t for t in loaded.state_dict().values() if t.ndim == 4 and t.shape[0] > 1]
    assert len(conv_weights) == 6 and all(t.dtype == torch.int8 for t in conv_weights)  # no fp32 copies
    x = torch.from_numpy(calibration[:8])
    with torch.no_grad():
        assert (loaded(x).argmax(1) == model(x).argmax(1)).float().mean() >= 0.75
    (tmp_path / "bad.pt2").write_bytes(b"nope")
    with pytest.raises(StageError, match=r"bad.pt2: not a readable torch.export archive"):
        load_exported(tmp_path / "bad.pt2")


def test_distillation_pulls_the_pruned_model_towards_the_teacher(workdir: Path) -> None:
    """With optimize.finetune_distill = 1 the fine-tune learns the unpruned model's outputs only, so the
    pruned student ends much closer to its teacher than before, and closer than labels-only fine-tuning."""
    import copy

    from pipeline.optimize.finetune import finetune

    write_prepared(workdir, size=16)
    teacher, _ = model_file.read(write_model(workdir, steps=60))
    x = torch.from_numpy(read_split("test", workdir / "data" / "prepared").images).permute(0, 3, 1, 2).float() / 255

    def gap(student: nn.Module) -> float:
        with torch.no_grad():
            return float(
                torch.nn.functional.kl_div(
                    student.eval()(x).log_softmax(1), teacher(x).log_softmax(1), log_target=True, reduction="batchmean"
                )
            )

    pruned = copy.deepcopy(teacher)
    prune.prune_filters(pruned, 0.5, "l1")
    before = gap(pruned)
    distilled = finetune(
        copy.deepcopy(pruned), _params(finetune_epochs=6, finetune_lr=0.001, finetune_distill=1.0), teacher=teacher
    )
    labels_only = finetune(
        copy.deepcopy(pruned), _params(finetune_epochs=6, finetune_lr=0.001, finetune_distill=0.0), teacher=teacher
    )
    assert gap(distilled) < 0.5 * before
    assert gap(distilled) < gap(labels_only)


def test_pruning_a_committee_prunes_every_member(tmp_path: Path) -> None:
    torch.manual_seed(0)
    committee = _randomize_bn(nets.build("signnet", MEAN, STD, 32, width=8, members=2)).eval()
    report = prune.prune_filters(committee, 0.5, "l1")
    assert report.channels_before == [8, 8, 16, 16, 32, 32] * 2
    assert report.channels_after == [4, 4, 8, 8, 16, 16] * 2
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        out = committee(x)
    assert out.shape == (3, 43) and torch.isfinite(out).all()
    like = {"arch": nets.arch_kwargs("signnet", 32, 8, 0.2, members=2), "mean": MEAN, "std": STD, "classes": []}
    model_file.write_like(tmp_path / "pruned.pt", committee, like)
    reloaded, _ = model_file.read(tmp_path / "pruned.pt")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), out)


def test_kept_channels_round_down_to_the_kernels_block() -> None:
    """prune_multiple: 37.5 % of 32 filters leaves 20, rounded down to 16; 40 and 80 stay; never below the
    multiple, never more than the layer has, never none."""
    assert [prune.kept_channels(c, 0.375, 8) for c in (32, 64, 128)] == [16, 40, 80]
    assert [prune.kept_channels(c, 0.375, 1) for c in (32, 64, 128)] == [20, 40, 80]
    assert prune.kept_channels(32, 0.9, 8) == 8 and prune.kept_channels(4, 0.5, 8) == 4
    assert prune.kept_channels(3, 0.9, 1) == 1


def test_keep_members_takes_the_first_networks_of_a_committee(tmp_path: Path) -> None:
    """prune_members 1: the committee's first network alone (its own outputs), saved and reloaded as one network
    (arch members 1); 0, or as many as the committee has, keeps the committee."""
    torch.manual_seed(0)
    committee = nets.build("signnet", [0.5] * 3, [0.25] * 3, 16, width=8, members=3).eval()
    x = torch.rand(4, 3, 16, 16)
    one = prune.keep_members(committee, 1)
    assert isinstance(one, SignNet)
    with torch.no_grad():
        torch.testing.assert_close(one(x), committee.members[0](x))
    two = prune.keep_members(committee, 2)
    assert isinstance(two, nets.Committee) and len(two.members) == 2
    assert prune.keep_members(committee, 0) is committee and prune.keep_members(committee, 3) is committee
    assert prune.keep_members(one, 1) is one
    prune.prune_filters(one, 0.5, "l1", 1)
    like = {"arch": nets.arch_kwargs("signnet", 16, width=8, members=1), "mean": [0.5] * 3, "std": [0.25] * 3}
    model_file.write_like(tmp_path / "pruned.pt", one, like)
    reloaded, payload = model_file.read(tmp_path / "pruned.pt")
    assert payload["arch"]["members"] == 1
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), one(x))


def test_filters_are_ranked_with_their_batchnorm_scale_folded_in() -> None:
    """BN divides a filter's own scale out, so the raw weight norm says nothing about what the channel
    contributes: a big filter that BN scales down to nothing goes first, a small one BN scales up stays."""
    torch.manual_seed(0)
    model = _randomize_bn(nets.build("signnet", MEAN, STD, 32, width=8))
    conv, bn = model.features[0], model.features[1]  # type: ignore[index]
    assert isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d)
    with torch.no_grad():  # BN's running variance follows its filter's scale, as training makes it
        conv.weight[0] *= 100.0
        bn.running_var[0] *= 100.0**2
        bn.weight[0] = 1e-4
        conv.weight[1] *= 0.01
        bn.running_var[1] *= 0.01**2
        bn.weight[1] = 50.0
    raw, folded = prune.filter_norms(conv, "l1"), prune.filter_norms(conv, "l1", bn)
    assert raw.argmax() == 0 and raw.argmin() == 1
    assert folded.argmin() == 0 and folded.argmax() == 1
    prune.prune_filters(model, 0.125, "l1")  # 1 of 8 filters of each conv: channel 0 of the first
    assert bn.num_features == 7 and float(bn.weight.min()) > 0.4 and float(bn.weight.max()) == 50.0


def test_every_variant_records_its_served_accuracy_on_the_original_files(tiny_project: Path) -> None:
    """optimize measures each variant on what users send (the original test files, whole, decoded by the
    server's code): the figure deploy's smoke test must reproduce through the API."""
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.runtimes import open_runtime, read_manifest
    from pipeline.serve.protocol import decode_images

    manifest = read_manifest(tiny_project / "models")
    originals = read_test_files(tiny_project / "data" / "prepared")
    images = decode_images([(f.read_bytes(), None) for f in originals], manifest.preprocess.framing(), MAX_PIXELS)
    labels = np.asarray([f.label for f in originals])
    for variant in manifest.accepted():
        assert variant.served_accuracy is not None, variant.name
        runtime = open_runtime(tiny_project / "models", variant.name)
        assert variant.served_accuracy == float((runtime.predict(images).argmax(1) == labels).mean())


def test_the_gate_judges_only_images_no_variant_learnt_from(tiny_project: Path) -> None:
    """The tiny project trains on validation too (train.train_on_val, the tests' recipe), so the gate reads no labels:
    each variant's top-1 agreement with fp32 on the served test files, recomputed here through the runtimes; its
    drop is the disagreement, and no validation figure enters it."""
    from pipeline.artifacts.prepared import read_manifest as read_prepared
    from pipeline.artifacts.prepared import read_test_files
    from pipeline.images.preprocess import MAX_PIXELS
    from pipeline.runtimes import open_runtime, read_manifest
    from pipeline.serve.protocol import decode_images

    prepared = tiny_project / "data" / "prepared"
    assert read_prepared(prepared).framing == "served"
    manifest = read_manifest(tiny_project / "models")
    originals = read_test_files(prepared)
    images = decode_images([(f.read_bytes(), None) for f in originals], manifest.preprocess.framing(), MAX_PIXELS)
    reference = open_runtime(tiny_project / "models", "fp32").predict(images).argmax(1)
    fp32 = next(v for v in manifest.variants if v.name == "fp32")
    assert manifest.baseline_accuracy == fp32.details["gate_accuracy"] == 1.0
    for variant in manifest.accepted():
        agreement = float(
            (open_runtime(tiny_project / "models", variant.name).predict(images).argmax(1) == reference).mean()
        )
        assert variant.details["gate_images"] == len(originals), variant.name
        assert "val_accuracy" not in variant.details, variant.name
        assert variant.details["gate_accuracy"] == pytest.approx(agreement, abs=1e-9), variant.name
        assert variant.accuracy_drop == pytest.approx(1.0 - agreement, abs=1e-9)
    assert "no labels read" in (tiny_project / "reports" / "optimize" / "variants.md").read_text()


def test_validation_joins_the_gate_only_when_the_model_held_it_out(tiny_project: Path) -> None:
    """held_out_validation: the prepared validation split (as served) when train.train_on_val is false, nothing
    when the model trained on it or when prepare framed it by the ROI box instead of as served."""
    import contextlib

    from pipeline.artifacts.prepared import read_manifest as read_prepared
    from pipeline.artifacts.prepared import read_split
    from pipeline.optimize.candidates import held_out_validation

    prepared = read_prepared(tiny_project / "data" / "prepared")
    with contextlib.chdir(tiny_project):
        val = read_split("val", tiny_project / "data" / "prepared")
        held_out = held_out_validation(parse_params({"train": {"train_on_val": False}}), prepared)
        assert held_out is not None
        assert np.array_equal(held_out.labels, val.labels)
        assert np.array_equal(np.concatenate(list(held_out.batches(7))), val.model_input())  # batch by batch
        assert held_out_validation(parse_params({"train": {"train_on_val": True}}), prepared) is None
        roi = prepared.model_copy(update={"framing": "roi"})
        assert held_out_validation(parse_params({"train": {"train_on_val": False}}), roi) is None


def test_a_distilled_student_learns_the_teachers_outputs(workdir: Path) -> None:
    """distill_student trains a fresh, smaller network (train's warm-up, the teacher's soft targets): it ends
    far closer to the teacher than it started, and agrees with it on many more test images."""
    from pipeline.optimize.finetune import distill_student

    write_prepared(workdir, size=16)
    teacher, payload = model_file.read(write_model(workdir, steps=60))
    x = torch.from_numpy(read_split("test", workdir / "data" / "prepared").images).permute(0, 3, 1, 2).float() / 255
    torch.manual_seed(0)
    student = nets.build_from_arch({**payload["arch"], "width": 4}, payload["mean"], payload["std"])
    assert nets.count_macs(student, 16) < nets.count_macs(teacher, 16)

    def gap(model: nn.Module) -> float:
        with torch.no_grad():
            return float(
                torch.nn.functional.kl_div(
                    model.eval()(x).log_softmax(1), teacher(x).log_softmax(1), log_target=True, reduction="batchmean"
                )
            )

    def agreement(model: nn.Module) -> float:
        with torch.no_grad():
            return float((model.eval()(x).argmax(1) == teacher(x).argmax(1)).float().mean())

    before, agreed_before = gap(student), agreement(student)
    distilled = distill_student(student, teacher, _params(student_epochs=8, student_lr=0.01, student_distill=1.0))
    assert gap(distilled) < 0.7 * before
    assert agreement(distilled) > agreed_before + 0.2, (agreed_before, agreement(distilled))


def test_int8_onnx_quantizes_the_layers_and_keeps_the_networks_own_arithmetic_in_fp32(workdir: Path) -> None:
    """Only the convolutions, the classifier and what lies between them run int8: the per-image contrast
    normalisation (Sub, Pow, Sqrt, Add, Div) and the committee's vote read fp32 tensors, never a DequantizeLinear's
    output (quantizing them cost the default committee 0.19 points on the gate at the same speed)."""
    import onnx

    from pipeline.optimize import export, quantize

    torch.manual_seed(0)
    model = nets.build("signnet", MEAN, STD, 16, width=4, input_norm="image", members=2).eval()
    export.export_onnx(model, workdir / "fp32.onnx", 16)
    calibration = np.random.default_rng(0).random((64, 3, 16, 16), dtype=np.float32)
    quantize.quantize_onnx(workdir / "fp32.onnx", calibration, workdir / "int8.onnx")
    graph = onnx.load(str(workdir / "int8.onnx")).graph
    made_by = {output: node.op_type for node in graph.node for output in node.output}
    ops = {node.op_type for node in graph.node}
    assert {"Sub", "Div", "Sqrt", "LogSoftmax", "ReduceLogSumExp"} <= ops, ops
    for node in graph.node:
        sources = [made_by.get(name, "input or weight") for name in node.input if name]
        if node.op_type in {"Sub", "Div", "Pow", "Sqrt", "Add", "Mul", "Concat", "LogSoftmax", "ReduceLogSumExp"}:
            assert "DequantizeLinear" not in sources, (node.op_type, sources)
        if node.op_type in {"Conv", "Gemm"}:
            assert set(sources) == {"DequantizeLinear"}, (node.op_type, sources)


def test_int8_onnx_folds_relu6_into_the_convolutions_output_range(workdir: Path) -> None:
    """A depthwise ReLU6 network (EfficientNet-Lite's, MobileNet's blocks): each Clip is folded into the quantized
    range of the convolution before it, so no unbounded convolution output is quantized before its clip, and the
    int8 copy agrees with fp32 on the calibration-like images."""
    import onnx
    import onnxruntime as ort

    from pipeline.optimize import export, quantize

    torch.manual_seed(0)

    def block(cin: int, cout: int, groups: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.ReLU6()]

    model = nn.Sequential(
        *block(3, 16), *block(16, 16, groups=16), *block(16, 32), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, 5),
    ).eval()  # fmt: skip
    for bn in (m for m in model if isinstance(m, nn.BatchNorm2d)):  # statistics of a trained network, not identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.05, 0.5)
    export.export_onnx(model, workdir / "fp32.onnx", 32)
    images = np.random.default_rng(0).random((256, 3, 32, 32), dtype=np.float32)
    quantize.quantize_onnx(workdir / "fp32.onnx", images[:128], workdir / "int8.onnx")
    ops = [node.op_type for node in onnx.load(str(workdir / "int8.onnx")).graph.node]
    assert "Clip" in {n.op_type for n in onnx.load(str(workdir / "fp32.onnx")).graph.node}
    assert "Clip" not in ops and "QuantizeLinear" in ops, ops

    def top1(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {session.get_inputs()[0].name: images})[0].argmax(1)

    assert (top1(workdir / "int8.onnx") == top1(workdir / "fp32.onnx")).mean() >= 0.95


RESIDUAL = """
import torch
from torch import nn

from pipeline.architectures import NetSpec
from pipeline.architectures.nets import Normalize


class Residual(nn.Module):
    def __init__(self, spec: NetSpec) -> None:
        super().__init__()
        self.normalize = Normalize(spec.mean, spec.std)
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(self.normalize(x))
        x = torch.relu(x + self.block(x))  # the addition joins the stem's channels to the block's
        return self.head(x.mean((2, 3)))


def build(spec: NetSpec) -> nn.Module:
    return Residual(spec)
"""


def test_the_pruner_is_chosen_by_the_networks_structure_not_its_name(tmp_path: Path) -> None:
    """Chains of convolutions (ours) are pruned filter by filter; a residual addition or a depthwise convolution
    (in a network of yours as in a library's) sends the network to Torch-Pruning's dependency graph."""
    import contextlib

    from pipeline import architectures
    from pipeline.architectures import NetSpec
    from pipeline.optimize import prune

    (tmp_path / "residual.py").write_text(RESIDUAL)
    with contextlib.chdir(tmp_path):  # a project file's network, as model.name names it
        residual = architectures.builder("residual.py:build")(NetSpec(tuple(MEAN), tuple(STD), 16, 5))
    assert not prune.plain_chain(residual, 16)
    assert prune.plain_chain(nets.build("signnet", MEAN, STD, 16, width=4, members=2), 16)
    assert prune.plain_chain(nets.build("trafficsignnet", MEAN, STD, 32, num_classes=5), 32)
    depthwise = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3, groups=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                              nn.Linear(8, 5))  # fmt: skip
    assert not prune.plain_chain(depthwise, 16)


def test_a_residual_network_of_yours_is_pruned_and_passes_optimize(tiny_project: Path, tmp_path: Path) -> None:
    """Under the demo's recipe (pruning on), a project network with a residual block trains, and optimize prunes it
    through the dependency graph (the stem's and the block's channels cut together) and ships what passed."""
    import contextlib
    import json

    from pipeline.config import parse_params
    from pipeline.stages import optimize, train
    from tests.helpers.project import with_network

    work = tmp_path / "project"
    raw = with_network(tiny_project, work, RESIDUAL, "nets/residual.py")
    raw["optimize"] = {**raw.get("optimize", {}), "prune_amount": 0.5, "finetune_epochs": 1, "student_width": 0}
    params = parse_params(raw)
    with contextlib.chdir(work):
        train.run(params)
        optimize.run(params)
        manifest = json.loads(Path("models/manifest.json").read_text())
    pruned = next(v for v in manifest["variants"] if v["name"] == "pruned")
    before, after = json.loads(pruned["details"]["channels_before"]), json.loads(pruned["details"]["channels_after"])
    assert sum(after) < sum(before) and after[0] == after[2]  # the joined channels were cut together
    assert any(v["accepted"] for v in manifest["variants"])
