"""Features first: the packaged EfficientNet-Lite0 weights mapped onto timm's network, the frozen features cached
and reused, the head chosen on validation, a fine-tune kept only when validation prefers it, and the weights file a
dependency of train that DVC sees change."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from pipeline.architectures import backbones, nets
from pipeline.architectures import weights as packaged
from pipeline.artifacts import model as model_file
from pipeline.artifacts.checksum import sha256_of
from pipeline.config import parse_params
from pipeline.data.loader import Split
from pipeline.stages import train
from pipeline.training import features, head
from tests.helpers.prepared import write_prepared
from tests.helpers.project import make_project, run

LITE0 = "timm/efficientnet_lite0"
IMAGENET_DAISY = 985
# A folder in flower_photos' layout (<class>/<photos>), where a machine has one: not shipped with the tests (CC-BY
# photos with per-file authors), so the daisy check runs where it exists and is skipped, saying so, elsewhere.
PHOTOS_ENV = "PIPELINE_TEST_FLOWER_PHOTOS"


def test_packaged_weights_map_onto_timms_network_tensor_for_tensor_with_their_own_scaling() -> None:
    info, state = backbones.resolve(LITE0, "package")
    assert info.source == "package" and info.sha256 == sha256_of(Path(info.file)) and state is not None
    assert info.mean == (0.5, 0.5, 0.5) and info.std == (0.5, 0.5, 0.5) and info.license == "Apache-2.0"
    original = torch.load(info.file, map_location="cpu", weights_only=True)
    originals = [v for k, v in original.items() if not k.endswith("num_batches_tracked")]
    assert len(state) == len(originals) == 247
    for (name, mapped), source in zip(state.items(), originals, strict=True):
        assert torch.equal(mapped, source), name
    model = nets.build(LITE0, info.mean, info.std, 64, num_classes=5)
    assert backbones.load_into(model.net, state, info.file) == ["classifier.weight", "classifier.bias"]


def test_auto_prefers_the_pinned_package_with_the_network_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("network off in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    info, state = backbones.resolve(LITE0, "auto")
    assert info.source == "package" and state is not None
    monkeypatch.setattr(packaged, "PACKAGES", {})  # no package for it: the Hub, unreachable, then random, said so
    info, state = backbones.resolve(LITE0, "auto")
    assert info.source == "random" and state is None and "Hugging Face" in info.note


def test_a_missing_package_is_one_line_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    record = packaged.PACKAGES[LITE0]
    monkeypatch.setitem(packaged.PACKAGES, LITE0, packaged.PackagedWeights(
        "not_installed_weights_pkg", record.file, record.mean, record.std, record.interpolation, record.license))  # fmt: skip
    with pytest.raises(backbones.WeightsError) as caught:
        backbones.resolve(LITE0, "package")
    assert "not_installed_weights_pkg is not installed" in str(caught.value) and "\n" not in str(caught.value)


def _photos() -> Path | None:
    folder = os.environ.get(PHOTOS_ENV, "")
    return Path(folder) if folder and (Path(folder) / "daisy").is_dir() else None


@pytest.mark.skipif(_photos() is None, reason=f"{PHOTOS_ENV} names no flower_photos folder here")
def test_the_packaged_weights_see_a_daisy_in_imagenets_daisy_class() -> None:
    info, state = backbones.resolve(LITE0, "package")
    net = backbones.library_network(LITE0, 1000)
    net.load_state_dict(state)
    model = nets.Backbone(LITE0, info.mean, info.std, 1000)
    model.net = net.eval()
    photos = sorted((_photos() / "daisy").glob("*.jpg"))[:10]  # type: ignore[operator]
    batch = []
    for path in photos:
        image = Image.open(path).convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        square = image.crop((left, top, left + side, top + side)).resize((224, 224), Image.BILINEAR)
        batch.append(torch.from_numpy(np.array(square)).permute(2, 0, 1))
    with torch.no_grad():
        predicted = model(torch.stack(batch).float() / 255).argmax(1)
    assert int((predicted == IMAGENET_DAISY).sum()) >= 6, predicted.tolist()


def _toy_splits(n: int = 60, side: int = 32) -> tuple[Split, Split]:
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(n) % 3
    images = torch.randint(0, 60, (n, 3, side, side), generator=generator, dtype=torch.uint8)
    for c in range(3):  # a bright bar per class
        images[labels == c, c, side // 3 : 2 * side // 3] = 220
    images = images.contiguous(memory_format=torch.channels_last)
    return Split(images[: n - 15], labels[: n - 15]), Split(images[n - 15 :], labels[n - 15 :])


def test_the_head_is_kept_when_the_fine_tune_loses_on_validation(tmp_path: Path) -> None:
    """A fine-tune at an absurd learning rate wrecks the tail: validation keeps the head, and the tail's weights
    are back to the pretrained ones."""
    info, state = backbones.resolve(LITE0, "package")
    model = nets.build(LITE0, info.mean, info.std, 96, num_classes=3)
    backbones.load_into(model.net, state, info.file)
    before = {k: v.clone() for k, v in model.net.conv_head.state_dict().items()}
    train_split, val_split = _toy_splits(side=96)  # at 32 px the pretrained features are nearly constant
    run = features.FeaturesRun(tmp_path / "cache", "toy", 3, 600.0,
                               features.TailSettings(lr=50.0, weight_decay=0.0, label_smoothing=0.0, max_epochs=2),
                               refit_on_val=False)  # fmt: skip
    outcome = features.fit(model, 1, train_split, val_split, run)
    assert outcome.tail_epochs == 2 and outcome.tail_val_accuracy is not None
    assert outcome.head.val_accuracy == 1.0 and outcome.kept == "head"
    for key, value in model.net.conv_head.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert "not better beyond chance" in outcome.describe(96)


def test_a_fine_tune_is_kept_only_when_validation_tells_it_from_chance() -> None:
    """The best of 12 epochs right on 12 validation images the head got wrong and wrong on 4 it got right is what
    chance gives one time in 26 (McNemar's exact test), too often for a pick among 12: the head stays. 30 against 5
    is not chance; nor is a loss a win."""
    head_right = torch.tensor([False] * 12 + [True] * 4 + [True] * 200)
    tail_right = torch.tensor([True] * 12 + [False] * 4 + [True] * 200)
    close = head.Versus.of(head_right, tail_right, epochs=12)
    assert (close.gained, close.lost) == (12, 4) and abs(close.p_value - 2517 / 2**16) < 1e-12
    assert not close.tail_wins and head.Versus.of(head_right, tail_right, epochs=1).tail_wins
    clear = head.Versus(gained=30, lost=5, epochs=12)
    assert clear.p_value < 1e-4 and clear.tail_wins
    assert not head.Versus(gained=0, lost=0, epochs=1).tail_wins
    assert not head.Versus.of(tail_right, head_right, epochs=1).tail_wins


def _features_params(tmp_path: Path, **train: object):
    return parse_params({
        "model": {"name": LITE0, "weights": "package", "members": 1},
        "train": {"from_pretrained": "features", "tail_blocks": 1, "epochs": 1, "max_minutes": 1.0, "threads": 1,
                  "train_on_val": False, "checkpoint_dir": str(tmp_path / "checkpoints"), **train},
        "tracking": {"enabled": False},
    })  # fmt: skip


def test_a_features_run_writes_one_network_and_a_second_run_reuses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    write_prepared(work, sizes=(86, 43, 43), image_size=32)
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    train.run(_features_params(tmp_path))
    metrics = yaml.safe_load((work / "reports/train/metrics.json").read_text())
    assert metrics["method"] == "features" and metrics["features_cached"] is False
    assert metrics["kept"] in ("head", "tail") and 0.0 <= metrics["val_accuracy"] <= 1.0
    cached = list((tmp_path / "checkpoints/features").glob("*.pt"))
    assert len(cached) == 1
    model, payload = model_file.read()
    assert payload["arch"]["weights"]["source"] == "package" and payload["mean"] == [0.5, 0.5, 0.5]
    with torch.no_grad():
        assert model(torch.rand(2, 3, 32, 32)).shape == (2, 43)  # backbone + head: one network, as any other
    train.run(_features_params(tmp_path, tail_blocks=1, max_minutes=0.01))  # another budget: the same features
    again = yaml.safe_load((work / "reports/train/metrics.json").read_text())
    assert again["features_cached"] is True and list((tmp_path / "checkpoints/features").glob("*.pt")) == cached


def _recorded_weights(work: Path) -> str:
    lock = yaml.safe_load((work / "dvc.lock").read_text())
    return next(o["md5"] for o in lock["stages"]["weights"]["outs"] if o["path"] == "models/weights.json")


@pytest.mark.slow
def test_another_weights_file_changes_what_train_depends_on(tmp_path: Path) -> None:
    """Real DVC: the weights stage's record is train's dependency. After it ran, DVC sees it up to date; a file of
    yours replaced (with its new `model.weights_sha256`) changes the record, so `dvc repro` re-runs train."""
    work, env = make_project(tmp_path)
    weights = work / "weights.safetensors"

    def use(seed: int) -> None:
        torch.manual_seed(seed)
        net = backbones.library_network("timm/resnet10t", 1000)
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(weights))
        params = yaml.safe_load((work / "params.yaml").read_text())
        params["model"].update(
            {"name": "timm/resnet10t", "weights": str(weights), "weights_sha256": sha256_of(weights)}
        )
        (work / "params.yaml").write_text(yaml.safe_dump(params))

    dvc = [sys.executable, "-m", "dvc"]
    train_deps = yaml.safe_load((work / "dvc.yaml").read_text())["stages"]["train"]["deps"]
    assert "models/weights.json" in train_deps
    use(0)
    run([*dvc, "repro", "--single-item", "weights"], work, env)
    first = _recorded_weights(work)
    assert "Data and pipelines are up to date" in run([*dvc, "status", "weights"], work, env)
    use(1)
    assert "weights" in run([*dvc, "status", "weights"], work, env)
    run([*dvc, "repro", "--single-item", "weights"], work, env)
    assert _recorded_weights(work) != first
    assert sha256_of(weights) in (work / "models/weights.json").read_text()


def test_the_heads_settings_are_scored_on_images_each_fold_held_out() -> None:
    """Random labels on 256-d features of 300 images: a head fits its training images, but the folds score what it
    never saw, so chance; the same features with labels they carry score near 1. choose_head reports the folds'
    figure of the settings it chose."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 256, generator=generator)
    noise = torch.randint(0, 2, (300,), generator=generator)
    carried = torch.randint(0, 2, (300,), generator=generator)
    x[:, 0] += 4.0 * (2 * carried - 1)  # one feature carries these labels
    assert head.folds_accuracy((x, x), noise, 2, 1e-4, False) < 0.62
    assert head.folds_accuracy((x, x), carried, 2, 1e-4, False) > 0.9
    feats = {"train": x[:250], "train_mirrored": x[:250], "val": x[250:], "val_mirrored": x[250:]}
    choice, fitted = head.choose_head(feats, carried[:250], carried[250:], 2)
    assert (
        choice.folds_accuracy == head.folds_accuracy((x, x), carried, 2, choice.weight_decay, choice.mirrored)
        and choice.folds_accuracy > 0.9
        and fitted.out_features == 2
    )
