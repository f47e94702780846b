"""Networks by name (torchvision/<arch>, timm/<arch>) and their weights: loaded from a file the test makes or from a
pre-filled library cache with the network off, the classifier fresh, and every bad-weights case one line before
any training step; then the same network through prune (Torch-Pruning), save and reload."""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import pytest
import torch
import torchvision
from safetensors.torch import save_file

from pipeline.architectures import backbones, nets
from pipeline.artifacts import model as model_file
from pipeline.config import parse_params
from pipeline.errors import StageError
from pipeline.optimize import prune
from pipeline.stages import train
from tests.helpers.prepared import write_prepared

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


def tiny_params(name: str, weights: str = "none", sha256: str = "", **train_overrides: object):
    return parse_params(
        {
            "model": {"name": name, "weights": weights, "weights_sha256": sha256, "members": 1},
            "train": {
                "epochs": 1,
                "batch_size": 32,
                "checkpoint_every": 0,
                "threads": 1,
                "train_on_val": False,
                **train_overrides,
            },
            "tracking": {"enabled": False},
        }
    )


def imagenet_state(arch: str) -> dict[str, torch.Tensor]:
    """A full 1000-class state dict of the library's network (random: no hub answers here), as users download."""
    torch.manual_seed(123)
    return torchvision.models.get_model(arch, weights=None).state_dict()


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    write_prepared(work, sizes=(64, 32, 32), image_size=32)
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return work


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_weights_from_a_local_file_load_every_tensor_but_a_fresh_classifier(tmp_path: Path, suffix: str) -> None:
    state = imagenet_state("resnet18")
    path = tmp_path / f"resnet18{suffix}"
    if suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save(state, path)
    digest = backbones.sha256_of(path)
    info, loaded = backbones.resolve("torchvision/resnet18", str(path), digest)
    assert info.sha256 == digest and info.file == str(path) and loaded is not None
    model = nets.build("torchvision/resnet18", MEAN, STD, 32, num_classes=6)
    fresh_head = model.net.fc.weight.detach().clone()
    head = backbones.load_into(model.net, loaded, str(path))
    assert head == ["fc.weight", "fc.bias"]
    own = model.net.state_dict()
    for key, value in state.items():
        if not key.startswith("fc."):
            assert torch.equal(own[key], value), key
    assert own["fc.weight"].shape == (6, 512) and torch.equal(own["fc.weight"], fresh_head)


def test_default_weights_come_from_a_prefilled_torchvision_cache_with_the_network_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.weights: default` reads the library's own cache (TORCH_HOME): a file put there is used, and no
    connection is attempted (every socket refused)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    url = torchvision.models.get_model_weights("mobilenet_v3_small").DEFAULT.url
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name
    cached.parent.mkdir(parents=True)
    state = imagenet_state("mobilenet_v3_small")
    torch.save(state, cached)

    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network off in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    info, loaded = backbones.resolve("torchvision/mobilenet_v3_small", "default")
    assert info.source == "default" and info.file == str(cached) and loaded is not None
    assert list(info.mean) == [0.485, 0.456, 0.406]  # what torchvision's weights.transforms() states
    assert torch.equal(loaded["features.0.0.weight"], state["features.0.0.weight"])
    cached.unlink()  # not in the cache: the download fails, in one line saying where to put the file
    with pytest.raises(backbones.WeightsError) as missing:
        backbones.resolve("torchvision/mobilenet_v3_small", "default")
    assert (
        "\n" not in str(missing.value) and "TORCH_HOME" in str(missing.value) and Path(url).name in str(missing.value)
    )


class RunsCode:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this pickle ran code",))


def test_bad_weights_are_one_line_before_any_training_step(project: Path, tmp_path: Path) -> None:
    state = imagenet_state("resnet18")
    good = tmp_path / "good.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(good))
    wrong_shapes = tmp_path / "wide.safetensors"
    save_file({**{k: v.contiguous() for k, v in state.items()}, "conv1.weight": torch.zeros(32, 3, 7, 7)},
              str(wrong_shapes))  # fmt: skip
    other_net = tmp_path / "mobilenet.pth"
    torch.save(imagenet_state("mobilenet_v3_small"), other_net)
    hostile = tmp_path / "hostile.pth"
    hostile.write_bytes(pickle.dumps({"conv1.weight": RunsCode()}))
    cases = {
        "no such file": ("torchvision/resnet18", str(tmp_path / "missing.safetensors"), ""),
        "sha256 is": ("torchvision/resnet18", str(good), "0" * 64),
        "conv1.weight is (32, 3, 7, 7)": ("torchvision/resnet18", str(wrong_shapes), ""),
        "tensors the network does not have": ("torchvision/resnet18", str(other_net), ""),
        "refused, not a plain state dict": ("torchvision/resnet18", str(hostile), ""),
        "has no classification model": ("torchvision/resnet1800", "none", ""),
        "timm has no model": ("timm/not_a_model", "none", ""),
    }
    for expected, (name, weights, sha) in cases.items():
        with pytest.raises(StageError) as caught:
            train.run(tiny_params(name, weights, sha))
        message = str(caught.value)
        assert expected in message and "\n" not in message, (expected, message)
        if weights not in ("none", "default"):
            assert Path(weights).name in message
        assert not model_file.MODEL_PATH.exists()  # nothing trained, nothing written


@pytest.mark.parametrize("name", ["torchvision/mobilenet_v3_small", "timm/resnet10t"])
def test_a_library_network_trains_saves_and_reloads_with_its_weights_recorded(
    project: Path, tmp_path: Path, name: str
) -> None:
    """One short epoch through the train stage; the model file records the initial weights and the mean/std they
    expect, and loads back (weights only) to the same outputs."""
    arch = name.partition("/")[2]
    net = backbones.library_network(name, 1000)
    path = tmp_path / f"{arch}.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    train.run(tiny_params(name, str(path), backbones.sha256_of(path), backbone_lr_factor=0.1))
    model, payload = model_file.read()
    recorded = payload["arch"]["weights"]
    assert recorded["source"] == str(path) and recorded["sha256"] == backbones.sha256_of(path)
    assert payload["mean"] == recorded["mean"]  # normalised as the weights expect, not with the data's stats
    assert payload["arch"]["name"] == name and payload["arch"]["num_classes"] == 43
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (2, 43)


def test_backbone_and_head_learn_at_their_own_rates_and_the_backbone_waits_while_frozen() -> None:
    from pipeline.training.engine import Engine, Loss, make_optimizer

    model = nets.build("torchvision/resnet18", MEAN, STD, 32, num_classes=4)
    optim = make_optimizer(model, "adamw", 0.01, 0.0, backbone_lr_factor=0.1, frozen_steps=1)
    backbone_before = model.net.conv1.weight.detach().clone()
    head_before = model.net.fc.weight.detach().clone()
    engine = Engine(model, optim, lambda step: 0.01, Loss())
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    engine.step(0, images, labels, 4)
    assert torch.equal(model.net.conv1.weight, backbone_before)  # frozen for the first step
    assert not torch.equal(model.net.fc.weight, head_before)
    engine.step(1, images, labels, 4)
    assert not torch.equal(model.net.conv1.weight, backbone_before)
    assert sorted({g["lr"] for g in optim.param_groups}) == pytest.approx([0.001, 0.01])


@pytest.mark.parametrize("name", ["torchvision/resnet18", "torchvision/mobilenet_v3_small", "timm/efficientnet_b0"])
def test_branched_networks_prune_for_real_and_reload_from_their_state_dict(tmp_path: Path, name: str) -> None:
    """Residual additions, depthwise convolutions and squeeze-excite: Torch-Pruning removes channels together,
    the network gets smaller and still runs, and the saved file rebuilds the same network (fit_shapes)."""
    torch.manual_seed(0)
    model = nets.build(name, MEAN, STD, 32, num_classes=5).eval()
    before = nets.count_macs(model, 32)
    report = prune.prune_graph(model, 0.25, 32, "l1", 8)
    after = nets.count_macs(model, 32)
    assert after < 0.8 * before and sum(report.channels_after) < sum(report.channels_before)
    x = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    assert expected.shape == (3, 5)
    arch = nets.arch_kwargs(name, 32, num_classes=5)
    path = model_file.write(tmp_path / "pruned.pt", arch, MEAN, STD, [str(i) for i in range(5)], model.state_dict())
    reloaded, _ = model_file.read(path)
    with torch.no_grad():
        assert torch.allclose(reloaded(x), expected, atol=1e-5)


def test_a_student_of_another_architecture_is_distilled_exported_and_judged(project: Path) -> None:
    """`optimize.student: torchvision/mobilenet_v3_small` from a resnet18 teacher: a fresh network of the named
    architecture, distilled, exported to ONNX with parity checked, in the manifest with what it was made from."""
    import json

    from pipeline.stages import optimize

    train.run(tiny_params("torchvision/resnet18"))
    params = parse_params(
        {
            **tiny_params("torchvision/resnet18").model_dump(mode="json"),
            "optimize": {
                "student": "torchvision/mobilenet_v3_small",
                "student_epochs": 1,
                "prune_amount": 0.0,
                "int8_torch": False,
                "int8_onnx": False,
                "bf16": "off",
                "max_accuracy_drop": 1.0,
                "calibration_images": 32,
            },
        }
    )
    optimize.run(params)
    manifest = json.loads(Path("models/manifest.json").read_text())
    variants = {v["name"]: v for v in manifest["variants"]}
    assert variants["student"]["details"]["student_architecture"] == "torchvision/mobilenet_v3_small"
    assert variants["student"]["details"]["macs"] < variants["fp32"]["details"]["macs"] / 3
    assert variants["student-onnx"]["accepted"] and variants["student-onnx"]["parity"]["passed"]
    payload = model_file.read(Path("models/variants/student.pt"))[1]
    assert payload["arch"]["name"] == "torchvision/mobilenet_v3_small" and "weights" not in payload["arch"]


def test_library_networks_train_as_one_network_whatever_model_members_says(project: Path) -> None:
    from pipeline.artifacts.prepared import read_manifest

    manifest = read_manifest(Path("data/prepared"))
    backbone = parse_params({"model": {"name": "torchvision/resnet18", "members": 2}})
    assert train.model_arch(backbone, manifest)["members"] == 1
    assert not isinstance(train.build_model(backbone, manifest), nets.Committee)
    ours = parse_params({"model": {"name": "signnet", "members": 2}})
    assert train.model_arch(ours, manifest)["members"] == 2


def test_batchnorm_statistics_are_re_estimated_on_the_training_images() -> None:
    """MobileNetV3's BatchNorm momentum is 0.01: after a short run its running statistics are still nearly their
    initial ones. Recalibrated, the first layer's running mean is the mean of its input over the images given."""
    from pipeline.data.loader import to_float
    from pipeline.training.engine import recalibrate_batchnorm

    torch.manual_seed(0)
    model = nets.build("torchvision/mobilenet_v3_small", MEAN, STD, 32, num_classes=3).eval()
    first_bn = model.net.features[0][1]
    assert first_bn.momentum == pytest.approx(0.01)
    images = torch.randint(0, 256, (40, 3, 32, 32), dtype=torch.uint8)
    assert recalibrate_batchnorm(model, images, 20) > 10  # equal batches: the average of batch means is the mean
    with torch.no_grad():
        conv_out = model.net.features[0][0](model.normalize(to_float(images)))
    assert torch.allclose(first_bn.running_mean, conv_out.mean(dim=(0, 2, 3)), atol=1e-4)
    assert first_bn.momentum == pytest.approx(0.01) and not model.training  # restored


def test_validation_and_the_kept_state_read_the_statistics_the_model_serves_with(project: Path) -> None:
    """torchvision's MobileNetV3 keeps BatchNorm statistics with momentum 0.01: after two steps they are ~2 % of the
    data's. With validation held out (the best epoch's state kept), the saved model's statistics are the data's own,
    re-estimated before validation, so a kept state never carries near-initial statistics."""
    from pipeline.data.loader import load_split, to_float

    train.run(tiny_params("torchvision/mobilenet_v3_small", early_stopping_patience=3))
    model, _ = model_file.read()
    first = model.net.features[0][1]  # the stem's BatchNorm
    images = load_split("train").images
    seen: list[torch.Tensor] = []
    hook = model.net.features[0][0].register_forward_hook(lambda m, i, o: seen.append(o.mean(dim=(0, 2, 3))))
    with torch.no_grad():
        model.eval()
        model(to_float(images[torch.linspace(0, len(images) - 1, 64).long()]))
    hook.remove()
    data_mean = seen[0]
    assert float(data_mean.abs().mean()) > 0.01  # the stem's outputs are not centred: there is something to track
    ratio = float((first.running_mean * data_mean).sum() / (data_mean * data_mean).sum())
    assert 0.8 < ratio < 1.2, ratio  # the data's statistics (momentum 0.01 alone would leave about 0.02)
